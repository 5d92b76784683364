"""The README tells the truth: every ``meshd`` flag it names exists, and its snippets run as written.

A newcomer follows the README literally; a renamed flag or a snippet that only worked on the
author's machine is the first thing they meet. These tests read the README itself, so a doc
change that breaks it fails here, not on a user's desk.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from meshd.cli import build_parser
from tests.support.repo import ROOT

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


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def run_snippet(heading: str, replace: dict[str, str] | None = None, timeout: float = 400):
    """The first README block under ``heading``, run with bash from the repository root: /tmp/
    becomes this run's own directory, ``replace`` swaps what must differ on a shared test machine,
    and every daemon the block started in the background is stopped on the way out."""
    if not (ROOT / ".venv" / "bin" / "activate").exists():
        pytest.skip("the quick start's .venv is not set up in this checkout")
    snippet = section((ROOT / "README.md").read_text(), heading)
    tmp = Path(tempfile.mkdtemp(prefix="mr-", dir="/tmp"))  # short: unix socket paths are limited
    try:
        script = snippet.replace("/tmp/", f"{tmp}/")
        for old, new in (replace or {}).items():
            assert old in script, f"{old!r} is no longer in the README block under {heading!r}"
            script = script.replace(old, new)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MESHD_")}
        wrapped = "set -eu\ntrap 'kill $(jobs -p) 2>/dev/null; wait' EXIT\n" + script
        done = subprocess.run(["bash", "-c", wrapped], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_two_daemons_on_one_machine_snippet_runs_as_written():
    """Verbatim but for /tmp/: free ports, loopback, names, one core each, both get layers."""
    if shutil.which("taskset") is None:
        pytest.skip("taskset (util-linux) is not installed")
    out = run_snippet("### Two daemons on one machine")
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] in (["a"], ["b"])}
    assert set(rows) == {"a", "b"}, out
    assert all(re.search(r"\[\d+,\d+\)", row) for row in rows.values()), out  # each has layers


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_home_assistant_curl_calls_run_as_written():
    """The key is refused without it and admitted with it on loopback; /api/tags lists the model
    and /api/chat answers. The block's fixed ports would clash with other tests' daemons (and an
    Ollama on this machine): this run takes free ones and advertises on loopback only."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    port = str(_free_port())
    out = run_snippet("**Try Home Assistant's calls first**", {
        "127.0.0.1:11434": f"127.0.0.1:{port}",
        "meshd join ": "meshd join --port 0 --pairing-port 0 --interface 127.0.0.1 ",
    })
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines[0] == "401", out
    tags = json.loads(lines[1])
    assert tags["models"] and tags["models"][0]["name"], out
    chat = json.loads(lines[2])
    assert chat["done"] is True and chat["message"]["content"].strip(), out


def quick_start_commands() -> list[str]:
    block = section((ROOT / "README.md").read_text(), "## Quick start")
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def test_only_the_test_command_fetches_the_tool_calling_model():
    """The demo is the newcomer's first command: it must not pull a 490 MB second model."""
    demo, tests = (ROOT / "scripts" / "demo.sh").read_text(), (ROOT / "scripts" / "test.sh").read_text()
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert re.search(r'setup\.sh"?\s*$', demo, re.M) and "--with-tool-model" not in demo
    assert re.search(r'setup\.sh"? --with-tool-model', tests)
    fetch = setup.index("model pull qwen2.5-coder-0.5b-instruct")
    assert setup.rfind('"${1:-}" = "--with-tool-model"', 0, fetch) != -1


def test_the_quick_start_is_two_commands_and_ci_runs_the_second():
    setup_and_demo, tests = quick_start_commands()
    assert setup_and_demo == "bash scripts/demo.sh" and tests == "bash scripts/test.sh"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in [line.strip() for line in ci], "CI must call the README's test command"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_quick_start_command_1_answers_through_two_daemons_and_says_the_model_is_a_demo(real_source):
    """As a newcomer types it (a shorter answer to keep the suite quick): set-up is a no-op once
    done and fetches no second model, the answer streams, the summary shows half-open layer
    ranges as --json does, and the note says what to use for a real home."""
    cmd = quick_start_commands()[0] + " --max-tokens 24"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHD_") or k == "MESHD_HOME"}
    done = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = [line for line in done.stdout.splitlines() if line.startswith("[") and "tokens/s" in line]
    assert summary and re.search(r"demo-a layers \[\d+,\d+\)", summary[-1]), done.stdout
    assert "… waiting for daemon demo-a to serve its API" in done.stderr
    assert "demo model" in done.stderr and "qwen2.5-coder-1.5b-instruct" in done.stderr


def test_the_hub_models_snippet_runs_against_a_stand_in_hub(tmp_path, monkeypatch, capsys):
    """The README's `meshd model ...` lines under "Models from the Hugging Face Hub", as written but for
    the placeholder repository, through meshd's own entry point, with HF_ENDPOINT on a stand-in Hub
    serving tiny GGUFs under the real repositories' names: the list names every model with its figure,
    the pulls fetch (both parts of the split set), list then shows them cached, and the join line's
    --model finds the pulled copy."""
    import shlex

    from meshd.model import store as model_store
    from meshd.cli import main
    from tests.support.gguf import write_tiny_gguf
    from tests.support.gguf_split import split_gguf
    from tests.support.hub_standin import HubStandIn

    block = section((ROOT / "README.md").read_text(), "**Models from the Hugging Face Hub.**")
    lines = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    commands = [line for line in lines if line.startswith("meshd model ")]
    join = next(line for line in lines if line.startswith("meshd join "))
    assert commands[:2] == ["meshd model list", "meshd model advise"] and len(commands) == 5
    single = write_tiny_gguf(tmp_path / "tiny.gguf", layers=2)
    (tmp_path / "split").mkdir()
    parts = split_gguf(single, tmp_path / "split" / "tiny.gguf", parts=2)
    for k in [k for k in os.environ if k.startswith(("MESHD_", "HF_"))]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("MESHD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    outputs = []
    with HubStandIn() as hub:
        hub.add("Qwen/Qwen3-8B-GGUF", {"Qwen3-8B-Q4_K_M.gguf": single.read_bytes()})
        hub.add("Qwen/Qwen2.5-7B-Instruct-GGUF", {f"qwen2.5-7b-instruct-q4_k_m-0000{i}-of-00002.gguf": p.read_bytes()
                                                  for i, p in enumerate(parts, 1)})
        hub.add("acme/tiny-GGUF", {"tiny.gguf": single.read_bytes()})
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        for cmd in commands + ["meshd model list"]:
            cmd = cmd.replace("hf:OWNER/REPO/FILE.gguf", "hf:acme/tiny-GGUF/tiny.gguf")
            rc = main(shlex.split(cmd)[1:])
            out = capsys.readouterr()
            assert rc == 0, f"{cmd}: {out.out[-2000:]}{out.err[-2000:]}"
            outputs.append(out.out)
    first, last = outputs[0], outputs[-1]
    for name, figure in (("qwen3:8b", "93.4 %"), ("qwen2.5:7b", "88.3 %"), ("qwen3:4b", "86.7 %"),
                         ("llama3.2:3b", "82.0 %"), ("qwen2.5-coder-1.5b-instruct", "48.0 %")):
        row = next(line for line in first.splitlines() if line.split()[:1] == [name])
        assert figure in row and ("GB" in row or "MB" in row), row
    assert "estimate" in outputs[1]
    cached = {line.split()[0] for line in last.splitlines() if line.startswith("  ") and "cached" in line}
    assert cached == {"qwen3:8b", "qwen2.5:7b"}, last
    assert len(hub.gets("qwen2.5-7b-instruct-q4_k_m-00002-of-00002.gguf")) == 1
    model = join.split("--model ", 1)[1].split()[0]
    assert model_store.resolve_model(model).read_bytes() == single.read_bytes()
