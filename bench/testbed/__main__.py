"""``python -m bench.testbed selftest [--link 100mbit,4ms] [--json]`` / ``cleanup [--prefix P] [--force]``."""

from __future__ import annotations

import argparse
import json
import os
import sys

from bench.testbed.linkspec import LinkSpec
from bench.testbed.netns import cleanup
from meshd.errors import MeshdError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.testbed", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("selftest", help="2 hosts: measured vs configured RTT and rate")
    st.add_argument("--link", default="100mbit,4ms", help="RATE[,RTT] or 'none' (default 100mbit,4ms)")
    st.add_argument("--mode", choices=("auto", "netns", "loopback"), default="auto")
    st.add_argument("--prefix", default="meshd-tb-selftest")
    st.add_argument("--bulk-mib", type=int, default=64)
    st.add_argument("--bulk-seconds", type=float, default=6.0)
    st.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    cl = sub.add_parser("cleanup", help="remove namespaces left by crashed testbeds")
    cl.add_argument("--prefix", default="meshd-tb", help="namespaces starting with this (default meshd-tb)")
    cl.add_argument("--force", action="store_true", help="also remove testbeds a live process owns")
    args = p.parse_args(argv)
    try:
        if args.cmd == "cleanup":
            if os.geteuid() != 0:
                print("testbed cleanup: not root, nothing to do (loopback testbeds leave nothing behind)")
                return 0
            removed, skipped = cleanup(args.prefix, force=args.force)
            print(f"testbed cleanup: removed {len(removed)} namespace(s)"
                  + (f": {' '.join(removed)}" if removed else ""))
            if skipped:
                print(f"testbed cleanup: left {len(skipped)} in use by a live testbed "
                      f"(--force to remove): {' '.join(skipped)}")
            return 0
        from bench.testbed.selftest import selftest

        out = selftest(LinkSpec.parse(args.link), prefix=args.prefix, mode=args.mode,
                       bulk_bytes=args.bulk_mib << 20, bulk_seconds=args.bulk_seconds)
        if args.json:
            print(json.dumps(out), flush=True)
        return 0
    except MeshdError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
