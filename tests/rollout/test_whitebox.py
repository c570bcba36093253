"""The white-box harness, driven by a scripted policy behind a fake streaming Chat Completions server; and its
package as the image holds it. Its parts one by one (stream parsing, arguments, observations, tools):
test_whitebox_parts.py."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from harness_images.whitebox import harness
from harness_images.whitebox.agent.cli import main
from harness_images.whitebox.agent.components import SYSTEM_PROMPTS
from pipeline.rollout.harness_space import (
    HarnessConfig,
    all_configs,
    offered_tools,
    tool_name_for,
)
from tests.helpers.fake_openai import Failure, FakeOpenAI, Reply

HARNESS = Path(harness.__file__)
INSTRUCTION = "Put 'gamma beta' into notes/a.txt and check the guide in the corpus."
GUIDE = "# Guide\nThe harness reads this guide. Search finds it by the word harness.\n"


# ------------------------------------------------------------------------------------- scripted episodes
def tool_script(config: HarnessConfig) -> list[list[tuple[str, dict | str]]]:
    """Main-agent turns in canonical names, translated to the configuration's tool interface. Includes a
    missing file, malformed JSON and an unknown tool: the harness must hand each back as a tool error."""

    def n(canonical: str) -> str:
        return tool_name_for(config, canonical)

    return [
        [(n("write_file"), {"path": "notes/a.txt", "content": "alpha beta\n"})],
        [(n("read_file"), {"path": "missing.txt"}), (n("read_file"), '{"path": ')],
        [
            (n("edit_file"), {"path": "notes/a.txt", "old": "alpha", "new": "gamma"}),
            (n("search"), {"query": "harness guide"}),
        ],
        [(n("fetch"), {"url": "corpus://guide.md"})],
        [("no_such_tool", {})],
        [(n("read_file"), {"path": "notes/a.txt"})],
    ]


def check_history(messages: list[dict]) -> None:
    """Every tool result answers a call of the assistant message before it, and every call is answered."""
    pending: set[str] = set()
    for m in messages:
        if m["role"] == "assistant":
            assert not pending, f"unanswered tool calls {pending}"
            pending = {tc["id"] for tc in m.get("tool_calls") or []}
        elif m["role"] == "tool":
            pending.remove(m["tool_call_id"])
        else:
            assert not pending


class ScriptedPolicy:
    """Plays tool_script per episode (keyed by API key), answers plan, summary and state requests."""

    def __init__(self) -> None:
        self.configs: dict[str, HarnessConfig] = {}
        self.step: dict[str, int] = defaultdict(int)

    def __call__(self, body: dict, headers: dict[str, str]) -> Reply:
        key = headers["authorization"].removeprefix("Bearer ")
        config = self.configs[key]
        assert [t["function"]["name"] for t in body["tools"]] == offered_tools(config)
        check_history(body["messages"])
        last = body["messages"][-1]
        if headers["x-bridle-call-label"] == "compaction":
            assert body["tool_choice"] == "none"
            return Reply("Wrote notes/a.txt; still to do: edit it and read the guide.")
        if last["role"] == "user" and "numbered plan" in last["content"]:
            return Reply("1. Write the notes. 2. Edit them. 3. Read the guide.")
        step = self.step[key]
        self.step[key] += 1
        script = tool_script(config)
        if step < len(script):
            return Reply("", script[step])
        return Reply("Done: notes/a.txt says gamma beta.")


def make_workspace(root: Path) -> tuple[Path, Path]:
    ws = root / "ws"
    (ws / "corpus").mkdir(parents=True)
    (ws / "corpus" / "guide.md").write_text(GUIDE)
    (root / "instruction.md").write_text(INSTRUCTION)
    return ws, root / "instruction.md"


def argv(config: str, ws: Path, instr: Path, base_url: str, transcript: Path, *extra: str) -> list[str]:
    return [
        "--config",
        config,
        "--workspace",
        str(ws),
        "--instruction-file",
        str(instr),
        "--base-url",
        base_url,
        "--model",
        "policy",
        "--max-turns",
        "30",
        "--transcript",
        str(transcript),
        "--api-retries",
        "0",
        "--summary-budget-chars",
        "500",
        "--compaction-budget-chars",
        "500",
        "--verify-every",
        "2",
        *extra,
    ]


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_realizations(config: HarnessConfig, evs: list[dict], ws: Path) -> None:
    kinds = [e["event"] for e in evs]
    start, end = evs[0], evs[-1]
    assert start["event"] == "start" and start["config"] == config.name
    assert start["realizations"] == config.realizations()
    assert start["system_prompt"] == SYSTEM_PROMPTS[config.s]
    assert start["tools"] == offered_tools(config)
    assert end["event"] == "end" and end["reason"] == "answer"
    assert (ws / "notes" / "a.txt").read_text() == "gamma beta\n"

    tools = [e for e in evs if e["event"] == "tool"]
    called = [e["canonical"] for e in tools]
    assert called == [
        "write_file",
        "read_file",
        "read_file",
        "edit_file",
        "search",
        "fetch",
        None,
        "read_file",
    ]
    assert all(e["name"] == tool_name_for(config, e["canonical"]) for e in tools if e["canonical"])
    if config.t == 2:
        assert all(e["name"].startswith("tool_") for e in tools if e["canonical"])
    assert [e["ok"] for e in tools] == [True, False, False, True, True, True, False, True]
    assert "not valid JSON" in tools[2]["output"] and "unknown tool 'no_such_tool'" in tools[6]["output"]
    assert "corpus://guide.md" in tools[4]["output"] and tools[5]["output"] == GUIDE
    for e in tools:
        if config.o == 0:
            assert e["observation"] == e["output"]
        elif config.o == 1:
            assert e["observation"].startswith("[sandbox-runner] job") and e["output"] in e["observation"]
        else:
            assert e["observation"].startswith("--- execution metadata ---")
            assert f"exit_code: {e['exit_code']}" in e["observation"]
            assert e["observation"].endswith("--- output ---\n" + e["output"])

    main_requests = [e for e in evs if e["event"] == "request" and e["label"] == "main"]
    assert ("plan" in kinds) == (config.w == 1)
    if config.w == 1:
        assert evs[kinds.index("plan")]["text"].startswith("1. Write")
        assert main_requests[0]["turn"] == 1
    assert ("verification" in kinds) == (config.w == 2)

    assert ("summary" in kinds) == (config.c == 1)
    assert ("segment" in kinds) == (config.c == 2)
    assert any(e["label"] == "compaction" for e in evs if e["event"] == "request") == (config.c > 0)
    if config.c == 0:
        sizes = [e["chars"] for e in main_requests]
        assert sizes == sorted(sizes)
    if config.c == 1:
        summary = evs[kinds.index("summary")]
        assert summary["replaced_messages"] >= 1 and summary["source"] == "model"
        after = next(e for e in evs[kinds.index("summary") :] if e["event"] == "request")
        assert [m["role"] for m in after["messages"]][:4] == ["system", "user", "user", "assistant"]
        assert all(e["segment"] == 0 for e in evs if "segment" in e)
    if config.c == 2:
        seg = evs[kinds.index("segment")]
        assert seg["segment"] == 1 and seg["state_file"] == ".harness_state.md"
        assert (ws / ".harness_state.md").read_text().startswith("Wrote notes/a.txt")
        after = next(e for e in evs[kinds.index("segment") :] if e["event"] == "request")
        roles = [m["role"] for m in after["messages"]]  # W2 may add its progress check after the restart
        assert after["segment"] == 1 and roles[:2] == ["system", "user"] and "assistant" not in roles
        assert end["segments"] >= 2


@pytest.mark.slow
def test_every_configuration_runs_a_scripted_episode(tmp_path, monkeypatch):
    policy = ScriptedPolicy()
    with FakeOpenAI(policy) as fake:
        for config in all_configs():
            ws, instr = make_workspace(tmp_path / config.name)
            key = f"key-{config.name}"
            policy.configs[key] = config
            monkeypatch.setenv("BRIDLE_API_KEY", key)
            transcript = tmp_path / config.name / "transcript.jsonl"
            assert main(argv(config.name, ws, instr, fake.base_url, transcript)) == 0, config.name
            check_realizations(config, events(transcript), ws)
    assert {r.headers["authorization"] for r in fake.requests} == {
        f"Bearer key-{c.name}" for c in all_configs()
    }
    assert all(r.body["stream"] and r.body["model"] == "policy" for r in fake.requests)


def test_cli_process_over_a_unix_socket(tmp_path):
    """The command line the sandbox pool uses, as a real process, reaching the server through a socket."""
    config = HarnessConfig.parse("S2T2O2C2W1")
    def n(canonical: str) -> str:
        return tool_name_for(config, canonical)

    script = [
        [(n("bash"), {"command": "echo from-bash > out.txt"})],
        [(n("python"), {"code": "print(open('out.txt').read().strip().upper())"})],
        [("tool_w0", {})],
    ]
    steps: list[int] = []

    def policy(body, headers):
        if headers["x-bridle-call-label"] == "compaction":
            return Reply("")  # an empty state: the harness writes its own digest instead
        if "numbered plan" in (body["messages"][-1].get("content") or ""):
            return Reply("1. Run bash. 2. Run python.")
        steps.append(1)
        return Reply("", script[len(steps) - 1]) if len(steps) <= len(script) else Reply("All done.")

    ws, instr = make_workspace(tmp_path)
    transcript = tmp_path / "t.jsonl"
    with FakeOpenAI(policy, unix_socket=str(tmp_path / "proxy.sock")) as fake:
        proc = subprocess.run(
            [
                sys.executable,
                str(HARNESS),
                *argv(
                    config.name,
                    ws,
                    instr,
                    fake.base_url,
                    transcript,
                    "--temperature",
                    "0.7",
                    "--max-tokens",
                    "256",
                ),
            ],
            env={**os.environ, "BRIDLE_API_KEY": "secret"},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert proc.returncode == 0, proc.stderr
    evs = events(transcript)
    tools = [e for e in evs if e["event"] == "tool"]
    assert [e["canonical"] for e in tools] == ["bash", "python", None]
    assert tools[1]["output"] == "FROM-BASH\n" and tools[2]["output"] == "cache already empty"
    assert evs[-1]["reason"] == "answer" and evs[-1]["answer"] == "All done."
    segment = next(e for e in evs if e["event"] == "segment")
    assert segment["source"] == "harness" and "echo from-bash" in (ws / ".harness_state.md").read_text()
    assert "-> cache already empty" in (ws / ".harness_state.md").read_text()  # unwrapped, despite O2
    req = fake.requests[0]
    assert req.path == "/v1/chat/completions" and req.headers["authorization"] == "Bearer secret"
    assert req.body["temperature"] == 0.7 and req.body["max_tokens"] == 256


def test_max_turns_ends_the_episode_normally(tmp_path, monkeypatch):
    monkeypatch.setenv("BRIDLE_API_KEY", "k")
    ws, instr = make_workspace(tmp_path)
    with FakeOpenAI(lambda body, h: Reply("", [("bash", {"command": "true"})])) as fake:
        args = argv("S0T0O0C0W0", ws, instr, fake.base_url, tmp_path / "t.jsonl")
        args[args.index("--max-turns") + 1] = "3"
        assert main(args) == 0
    end = events(tmp_path / "t.jsonl")[-1]
    assert (end["reason"], end["turns"]) == ("max_turns", 3) and len(fake.requests) == 3


@pytest.mark.parametrize(
    "failure,attempts",
    [(Failure(500), 1), (Failure(200, mid_stream=True), 1), (Failure(401, message="bad token"), 1)],
)
def test_api_failure_exits_nonzero(tmp_path, monkeypatch, failure, attempts):
    monkeypatch.setenv("BRIDLE_API_KEY", "k")
    ws, instr = make_workspace(tmp_path)
    with FakeOpenAI(lambda body, h: failure) as fake:
        assert main(argv("S0T0O0C0W0", ws, instr, fake.base_url, tmp_path / "t.jsonl")) == 1
    end = events(tmp_path / "t.jsonl")[-1]
    assert end["reason"] == "api_error" and failure.message in end["error"]
    assert len(fake.requests) == attempts


def test_retryable_failure_is_retried_and_401_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("BRIDLE_API_KEY", "k")
    ws, instr = make_workspace(tmp_path)
    answers = [Failure(503), Reply("Nothing to do.")]
    with FakeOpenAI(lambda body, h: answers.pop(0)) as fake:
        args = argv("S0T0O0C0W0", ws, instr, fake.base_url, tmp_path / "t.jsonl")
        args[args.index("--api-retries") + 1] = "1"
        assert main(args) == 0
    assert len(fake.requests) == 2
    with FakeOpenAI(lambda body, h: Failure(401)) as fake:
        args[args.index("--base-url") + 1] = fake.base_url
        assert main(args) == 1
    assert len(fake.requests) == 1


@pytest.mark.parametrize(
    "change,env,msg",
    [
        (("--config", "S0T0O0C0"), {"BRIDLE_API_KEY": "k"}, "expected a name like"),
        ((), {}, "BRIDLE_API_KEY is not set"),
        (("--base-url", "ftp://x"), {"BRIDLE_API_KEY": "k"}, "expected http"),
        (("--instruction-file", "/nonexistent/instr.md"), {"BRIDLE_API_KEY": "k"}, "instruction-file"),
    ],
)
def test_bad_invocation_exits_2(tmp_path, change, env, msg):
    ws, instr = make_workspace(tmp_path)
    args = argv("S0T0O0C0W0", ws, instr, "http://127.0.0.1:9/v1", tmp_path / "t.jsonl")
    if change:
        args[args.index(change[0]) + 1] = change[1]
    clean = {k: v for k, v in os.environ.items() if k != "BRIDLE_API_KEY"}
    proc = subprocess.run(
        [sys.executable, str(HARNESS), *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 2 and msg in proc.stderr


# ------------------------------------------------------------------------------------------ the package
def test_harness_imports_only_the_standard_library():
    """The image has python3 and nothing else, and harness code talks to bridle only over HTTP: every import
    in the package is relative or from the standard library (the entry script also names ``agent``)."""
    package = HARNESS.parent / "agent"
    for path in [HARNESS, *sorted(package.glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                modules = [node.module or ""]
            else:
                continue
            allowed = set(sys.stdlib_module_names) | ({"agent"} if path == HARNESS else set())
            bad = [m for m in modules if m.partition(".")[0] not in allowed]
            assert not bad, f"{path.name} imports {bad}"


def test_script_runs_alone_like_in_the_image(tmp_path):
    """harness.py and agent/ copied alone, as the Dockerfile does, run with no site-packages and no PYTHONPATH
    (``-E -S``): the script finds its package next to it and needs nothing else."""
    home = tmp_path / "opt"
    home.mkdir()
    shutil.copy2(HARNESS, home / "harness.py")
    shutil.copytree(HARNESS.parent / "agent", home / "agent", ignore=shutil.ignore_patterns("__pycache__"))
    ws, instr = make_workspace(tmp_path)
    write = tool_name_for(HarnessConfig.parse("S1T2O1C0W0"), "write_file")
    script = [Reply("", [(write, {"path": "done.txt", "content": "ok"})]), Reply("Finished.")]
    with FakeOpenAI(lambda body, h: script.pop(0), unix_socket=str(tmp_path / "proxy.sock")) as fake:
        proc = subprocess.run(
            [sys.executable, "-E", "-S", str(home / "harness.py"),
             *argv("S1T2O1C0W0", ws, instr, fake.base_url, tmp_path / "t.jsonl")],
            env={"BRIDLE_API_KEY": "k", "PATH": os.environ.get("PATH", "")},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert proc.returncode == 0, proc.stderr
    assert (ws / "done.txt").read_text() == "ok"
    evs = events(tmp_path / "t.jsonl")
    assert [e["event"] for e in evs] == ["start", "request", "response", "tool", "request", "response", "end"]
    assert evs[-1]["answer"] == "Finished." and evs[3]["observation"].startswith("[sandbox-runner] job 0001")
