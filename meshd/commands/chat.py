"""``meshd chat "TEXT"``: ask the local mesh one question and stream the answer.

The answer goes to stdout as it is generated (so it can be piped); a one-line
summary with token count and speed goes to stderr afterwards.
"""

from __future__ import annotations

import argparse
import sys

from meshd.client import MeshdClient

DEFAULT_MAX_TOKENS = 512
# What llama.cpp / Ollama users expect from a chat: varied but on-topic. (The API itself keeps
# OpenAI's temperature 1.0 default, which small models turn into rambling.)
DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 0.9


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "chat", help="ask the mesh a question and stream the answer",
        description="Send one chat message to the local meshd and stream the answer to stdout.",
    )
    p.add_argument("text", nargs="+", help="the message ('-' reads it from stdin)")
    p.add_argument("--socket", help="daemon socket (default: $MESHD_SOCKET, $RUNTIME_DIRECTORY, "
                                    "$XDG_RUNTIME_DIR/meshd/meshd.sock)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--max-tokens", type=_positive_int, default=DEFAULT_MAX_TOKENS,
                   help=f"most tokens to generate (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE,
                   help=f"sampling temperature (0 = greedy; default {DEFAULT_TEMPERATURE})")
    p.add_argument("--top-p", type=float, default=DEFAULT_TOP_P,
                   help=f"nucleus sampling mass (default {DEFAULT_TOP_P})")
    p.add_argument("--seed", type=int, default=None, help="sampling seed, for repeatable answers")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--quiet", "-q", action="store_true", help="no summary line")
    p.set_defaults(func=run)


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return v


def run(args) -> int:
    text = " ".join(args.text)
    if text == "-":
        text = sys.stdin.read()
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": text}
    ]
    client = MeshdClient(args.socket)
    stream = client.chat(messages, stream=True, max_tokens=args.max_tokens,
                         temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                         stop=args.stop)
    out = sys.stdout
    try:
        for piece in stream:
            out.write(piece)
            out.flush()
    finally:
        stream.close()
    out.write("\n")
    out.flush()
    if not args.quiet:
        print(summary_line(stream.usage, stream.elapsed_s, stream.ttft_s, stream.finish_reason),
              file=sys.stderr)
    return 0


def summary_line(usage: dict | None, elapsed_s: float, ttft_s: float | None,
                 finish: str | None) -> str:
    """``[42 tokens in 3.10 s: TTFT 0.40 s, 15.2 tokens/s; finish: stop]``."""
    n = (usage or {}).get("completion_tokens")
    parts = [f"{n} tokens in {elapsed_s:.2f} s" if n is not None else f"{elapsed_s:.2f} s"]
    detail = []
    if ttft_s is not None:
        detail.append(f"TTFT {ttft_s:.2f} s")
        decode_s = elapsed_s - ttft_s
        if n and n > 1 and decode_s > 0:
            detail.append(f"{(n - 1) / decode_s:.1f} tokens/s")
    if detail:
        parts.append(": " + ", ".join(detail))
    outline = (usage or {}).get("outline")
    if isinstance(outline, dict):
        parts.append(f"; outline: {outline.get('points')} points" if outline.get("used")
                     else f"; outline fell back ({outline.get('detail') or outline.get('fallback')})")
    parts.append(f"; finish: {finish or 'unknown'}")
    return "[" + "".join(parts) + "]"
