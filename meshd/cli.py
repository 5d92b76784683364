"""The ``meshd`` command line.

Each subcommand lives in its own module under ``meshd.commands`` and exposes
``register(subparsers)``; the module's parser sets ``func`` to a callable taking
the parsed args and returning an exit code. Keeping commands apart keeps this
file a table of contents.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from meshd import __version__
from meshd.errors import USER_ERRORS

# Order here is the order in ``meshd --help``.
COMMAND_MODULES = [
    "meshd.commands.join",
    "meshd.commands.invite",
    "meshd.commands.demo",
    "meshd.commands.generate",
    "meshd.commands.model",
    "meshd.commands.chat",
    "meshd.commands.status",
    "meshd.commands.apikey",
    "meshd.commands.plan",
    "meshd.commands.profile",
    "meshd.commands.heads",
    "meshd.commands.cloud",
]


class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser that refuses flags it does not know with its own usage line.

    argparse hands a subcommand's unknown arguments up to ``meshd``'s parser, whose usage
    says nothing about the subcommand's flags (``meshd join --prot 0`` would print
    ``usage: meshd [-h] ... COMMAND``). Nested subcommands inherit this class.
    """

    def parse_known_args(self, args=None, namespace=None):
        ns, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns, extra


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshd", description="Run one LLM together on the devices of your home."
    )
    parser.add_argument("--version", action="version", version=f"meshd {__version__}")
    parser.add_argument(
        "--log-format", choices=["console", "json"], default="console",
        help="log line format (json for journald)",
    )
    parser.add_argument("--log-level", default="warning")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_SubcommandParser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from meshd import log

    log.configure(args.log_format, args.log_level)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except USER_ERRORS as exc:  # expected, user-facing failures (any layer's): one clear line
        print(f"meshd: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
