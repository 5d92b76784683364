"""The README tells the truth: every ``meshd`` flag it names exists, and its snippets run as written.

A newcomer follows the README literally; a renamed flag or a snippet that only worked on the
author's machine is the first thing they meet. These tests read the README itself, so a doc
change that breaks it fails here, not on a user's desk.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from meshd.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "systemd" / "README.md"]

_FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.S | re.M)
_INLINE = re.compile(r"`([^`\n]+)`")
_MESHD = re.compile(r"(?<![\w/.-])meshd(?![\w/.-])")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_SEPARATORS = re.compile(r"\|\||&&|[|;&()#]|\$\(")


def code_of(text: str) -> list[str]:
    """Every command-like piece of a document: fenced lines (continuations joined) and inline spans."""
    pieces = []
    for block in _FENCE.findall(text):
        pieces += block.replace("\\\n", " ").splitlines()
    pieces += _INLINE.findall(_FENCE.sub("", text))
    return pieces


def section(text: str, heading: str) -> str:
    """The first fenced block under ``heading``."""
    start = text.index(heading)
    return _FENCE.search(text, start).group(1)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def meshd_invocations(piece: str):
    """(subcommand path, flags) for each ``meshd ...`` command in one piece of shell."""
    for part in _SEPARATORS.split(piece):
        # one command per part: the last "meshd" (in `sudo -u meshd env ... meshd join` the first is a user)
        matches = list(_MESHD.finditer(part))
        if not matches:
            continue
        rest = part[matches[-1].end():]
        path, parser = [], build_parser()
        for w in rest.split():
            sub = _subcommands(parser)
            if w not in sub:
                break
            path.append(w)
            parser = sub[w]
        yield tuple(path), parser, _FLAG.findall(rest)


def test_every_meshd_flag_the_docs_name_exists():
    root_flags = set(build_parser()._option_string_actions)
    missing, seen = [], 0
    for doc in DOCS:
        for piece in code_of(doc.read_text()):
            for path, parser, flags in meshd_invocations(piece):
                known = set(parser._option_string_actions) | root_flags
                for flag in flags:
                    seen += 1
                    if flag not in known:
                        missing.append(f"{doc.name}: `meshd {' '.join(path)} {flag}` in: {piece.strip()}")
    assert seen > 50, f"only {seen} flags found: the extraction is broken"
    assert not missing, "flags the docs name that the CLI does not have:\n" + "\n".join(missing)


def test_the_check_above_would_catch_a_flag_that_does_not_exist():
    [(path, parser, flags)] = list(meshd_invocations("meshd join --new-home x --no-such-flag 1"))
    assert path == ("join",) and "--no-such-flag" in flags
    assert "--no-such-flag" not in parser._option_string_actions and "--new-home" in parser._option_string_actions


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_two_daemons_on_one_machine_snippet_runs_as_written():
    """The README block, verbatim except that /tmp/ becomes a fresh directory of this test's."""
    if not (ROOT / ".venv" / "bin" / "activate").exists():
        pytest.skip("the quick start's .venv is not set up in this checkout")
    if shutil.which("taskset") is None:
        pytest.skip("taskset (util-linux) is not installed")
    snippet = section((ROOT / "README.md").read_text(), "### Two daemons on one machine")
    tmp = Path(tempfile.mkdtemp(prefix="mr-", dir="/tmp"))  # short: unix socket paths are limited
    try:
        script = snippet.replace("/tmp/", f"{tmp}/")
        assert script != snippet
        env = {k: v for k, v in os.environ.items() if not k.startswith("MESHD_")}
        # a daemon the snippet left running would outlive the test: stop them all on the way out
        wrapped = "set -eu\ntrap 'kill $(jobs -p) 2>/dev/null; wait' EXIT\n" + script
        done = subprocess.run(["bash", "-c", wrapped], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=400)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        rows = {line.split()[0]: line for line in done.stdout.splitlines() if line.split()[:1] in (["a"], ["b"])}
        assert set(rows) == {"a", "b"}, done.stdout
        assert all(re.search(r"\[\d+,\d+\)", row) for row in rows.values()), done.stdout  # each has layers
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
