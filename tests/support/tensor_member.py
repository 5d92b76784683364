"""One member of a tensor-parallel group in its own process, over the group's CurveZMQ links.

    python -m tests.support.tensor_member --rank R --size N [--model PATH] [--prompt TEXT] [--steps K]
        [--logits-out FILE]

Prints ``{"endpoint", "public"}`` on stdout, reads the group's members (``[{"rank", "endpoint",
"public"}]``) as one line on stdin, then the first member leads: it prefills ``--prompt`` and decodes
``--steps`` greedy tokens, printing ``{"step": i}`` as it goes and ``{"tokens": [...]}`` at the end (or
``{"lost": why}`` when a member leaves), the logits into ``--logits-out``; the others follow it.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--model")
    ap.add_argument("--prompt", default="The lighthouse keeper climbed the stairs at dusk, and")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ids", default=None, help="the prompt as token ids (JSON list), instead of --prompt")
    ap.add_argument("--logits-out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from decoding.tensor_group import GroupLost
    from meshd.model import store
    from meshd.pipeline.tensor.grouped import GroupedStage
    from meshd.pipeline.tensor.member import follow, load_member
    from transport.group_link import GroupLink, GroupPeer
    from transport.keys import Keypair

    source = store.open_model(args.model)
    keys = Keypair.generate()
    link = GroupLink(args.rank, args.size, keys)
    stage, split = load_member(source, 0, source.config.num_layers, args.size, args.rank, link)
    say({"endpoint": link.endpoint, "public": keys.public.decode()})
    peers = [GroupPeer(p["rank"], p["endpoint"], p["public"].encode()) for p in json.loads(sys.stdin.readline())]
    link.connect([p for p in peers if p.rank != args.rank])
    try:
        if args.rank:
            follow(stage, link)
            return 0
        grouped = GroupedStage(stage, link, split)
        kv = grouped.new_cache(1 << 14)
        prompt = json.loads(args.ids) if args.ids else source.tokenizer.encode(args.prompt)
        kv.create("s", len(prompt) + args.steps + 1)
        logits = [grouped.forward(kv, "s", torch.tensor(prompt), all_logits=False)[-1]]
        tokens = []
        for i in range(args.steps):
            tokens.append(int(logits[-1].argmax()))
            logits.append(grouped.forward(kv, "s", torch.tensor([tokens[-1]]), all_logits=False)[-1])
            say({"step": i})
        kv.free("s")
        grouped.close()
        if args.logits_out:
            torch.save(torch.stack(logits), args.logits_out)
        say({"tokens": tokens, "native_exchanges": link.native_exchanges})
    except GroupLost as exc:
        say({"lost": str(exc)})
    finally:
        link.close()  # (closing twice is harmless)
    return 0


def say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


if __name__ == "__main__":
    sys.exit(main())
