"""All 243 white-box configurations end to end: the real proxy (scripted engine), the local sandbox backend, a
built-in create_file task and its verifier. Each episode plays a per-rollout script (RolloutRequest.script) in
the configuration's tool names; the harness's transcript must show every realization of the configuration.

The harness is started with context budgets of one character and a progress check every turn, so C1/C2 manage the
context after every tool turn and W2 checks progress after every tool turn: short episodes reach every mechanism.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import anyio
import msgspec
import pytest
from proxyutil import running_proxy

from harness_images.whitebox import harness as wb
from pipeline.harness_space import HarnessConfig, all_configs, offered_tools, tool_name_for
from pipeline.messages import CallFailed, ModelCall, RolloutFinished, RolloutRequest
from pipeline.sandbox import LocalBackend, LocalSettings
from pipeline.scripted_engine import ScriptCall, ScriptResponse
from pipeline.taskgen import generate
from pipeline.tasks import Task, materialize

pytestmark = pytest.mark.slow

CONCURRENCY = 8
HARNESS_ARGS = ["--summary-budget-chars", "1", "--compaction-budget-chars", "1", "--verify-every", "1",
                "--api-retries", "0"]  # no retries: a retry would advance the script and hide the failure
PLAN = "1. Write the file. 2. Read it back. 3. Report."
STATE = "Wrote the file; still to do: read it back and report."
DONE = "Done: the file holds the requested text."
CONFIGS = all_configs()


def episode(config: HarnessConfig, task: Task) -> list[tuple[str, ScriptResponse]]:
    """(label, response) of every model call the harness makes, in order: the scripted engine plays responses
    in arrival order whatever the label, so compaction answers must sit exactly where the harness asks."""
    write = task.oracle_actions[0]
    assert write.tool == "write_file"
    calls = [ScriptCall(name=tool_name_for(config, "write_file"), arguments=write.args),
             ScriptCall(name=tool_name_for(config, "read_file"), arguments={"path": write.args["path"]})]
    steps = [("main", ScriptResponse(text=PLAN))] if config.w == 1 else []
    # C1 summarizes only when the body holds more turn groups (each starts at an assistant message) than the
    # one it keeps verbatim; the plan and its acknowledgement form a group of their own.
    groups = 1 if config.w == 1 else 0
    for call in calls:
        steps.append(("main", ScriptResponse(tool_calls=[call])))
        groups += 1
        if config.c == 2 or (config.c == 1 and groups > 1):
            steps.append(("compaction", ScriptResponse(text=STATE)))
            groups = 2  # the summary message and the kept turn
    steps.append(("main", ScriptResponse(text=DONE)))
    return steps


@dataclass
class Outcome:
    labels: list[str]  # what the script expects
    finished: RolloutFinished
    calls: list[ModelCall]
    failed: list[CallFailed]
    root: Path  # the kept rollout directory: app/ (workspace), home/transcript.jsonl, logs/


def run_all(tmp: Path) -> dict[str, Outcome]:
    task = materialize(generate("create_file", 7), tmp / "task")
    settings = LocalSettings(workdir=str(tmp / "work"), keep_workspaces=True, whitebox_args=HARNESS_ARGS)
    outcomes: dict[str, Outcome] = {}

    async def main() -> None:
        backend = LocalBackend(settings)
        await backend.start()
        limiter = anyio.CapacityLimiter(CONCURRENCY)
        async with running_proxy() as (proxy, records, _):

            async def one(config: HarnessConfig) -> None:
                steps = episode(config, task)
                rid = f"wb-{config.name}"
                req = RolloutRequest(
                    rollout_id=rid, group_id=rid, index=0, group_size=1, task_id=task.id,
                    harness=f"whitebox:{config.name}", token=f"tok-{config.name}", policy_version=0,
                    timeout_s=120.0, script=[msgspec.to_builtins(r) for _, r in steps],
                )
                proxy.register(req)
                async with limiter:
                    fin = await backend.run(req, task, proxy_url=proxy.base_url, proxy_socket=proxy.unix_socket)
                (root,) = (tmp / "work").glob(f"bridle-{rid}-*")
                outcomes[config.name] = Outcome(
                    labels=[label for label, _ in steps], finished=fin,
                    calls=sorted((r for r in records if isinstance(r, ModelCall) and r.rollout_id == rid),
                                 key=lambda c: c.seq),
                    failed=[r for r in records if isinstance(r, CallFailed) and r.rollout_id == rid],
                    root=root,
                )

            async with anyio.create_task_group() as tg:
                for config in CONFIGS:
                    tg.start_soon(one, config)
        await backend.aclose()

    anyio.run(main)
    return outcomes


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, Outcome]:
    return run_all(tmp_path_factory.mktemp("whitebox_proxy"))


def test_every_configuration_ran(outcomes):
    assert sorted(outcomes) == sorted(c.name for c in CONFIGS) and len(outcomes) == 243


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_configuration_end_to_end(outcomes, config):
    out = outcomes[config.name]
    fin = out.finished
    assert (fin.status, fin.reward, fin.exit_code) == ("ok", 1.0, 0), fin.details

    # The proxy: one ModelCall per scripted response, compaction calls labelled as such, nothing failed.
    assert out.failed == []
    assert [c.label for c in out.calls] == out.labels
    assert all(len(c.output_ids) > 0 and c.finish_reason in ("stop", "tool_calls") for c in out.calls)

    evs = [json.loads(line) for line in (out.root / "home" / "transcript.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in evs]
    start, end = evs[0], evs[-1]
    assert start["event"] == "start" and start["config"] == config.name
    assert start["realizations"] == config.realizations()
    assert start["system_prompt"] == wb.SYSTEM_PROMPTS[config.s]
    assert start["tools"] == offered_tools(config)
    assert (end["event"], end["reason"], end["answer"]) == ("end", "answer", DONE)
    assert [e["label"] for e in evs if e["event"] == "request"] == out.labels

    # T: the calls arrive under the configuration's names (opaque ids under T2) and reach the canonical tools.
    tools = [e for e in evs if e["event"] == "tool"]
    assert [e["canonical"] for e in tools] == ["write_file", "read_file"]
    assert [e["name"] for e in tools] == [tool_name_for(config, e["canonical"]) for e in tools]
    assert all(e["name"].startswith("tool_") for e in tools) == (config.t == 2)
    assert all(e["ok"] for e in tools)
    written = tools[0]["arguments"]
    assert tools[1]["output"] == json.loads(written)["content"]

    # O: raw results, the simulated infrastructure wrapper, or the execution-metadata wrapper.
    for e in tools:
        if config.o == 0:
            assert e["observation"] == e["output"]
        elif config.o == 1:
            assert e["observation"].startswith("[sandbox-runner] job") and e["output"] in e["observation"]
        else:
            assert e["observation"].startswith("--- execution metadata ---")
            assert f"tool: {e['name']}" in e["observation"] and "exit_code: 0" in e["observation"]
            assert e["observation"].endswith("--- output ---\n" + e["output"])

    # W: a plan before any tool (W1), a progress check after every tool turn (W2).
    plans = [e for e in evs if e["event"] == "plan"]
    assert [p["text"] for p in plans] == ([PLAN] if config.w == 1 else [])
    if config.w == 1:
        assert kinds.index("plan") < kinds.index("tool")
    assert kinds.count("verification") == (len(tools) if config.w == 2 else 0)

    # C: the model's summary replaces older turns (C1); the state goes to a file and a new segment starts (C2).
    compactions = out.labels.count("compaction")
    summaries = [e for e in evs if e["event"] == "summary"]
    segments = [e for e in evs if e["event"] == "segment"]
    state_file = out.root / "app" / ".harness_state.md"
    if config.c == 0:
        assert (summaries, segments, compactions) == ([], [], 0) and not state_file.exists()
    if config.c == 1:
        assert len(summaries) == compactions >= 1 and segments == []
        assert all(s["source"] == "model" and s["summary"] == STATE and s["replaced_messages"] >= 1
                   for s in summaries)
        assert end["segments"] == 1
    if config.c == 2:
        assert summaries == [] and len(segments) == compactions == 2
        assert [s["segment"] for s in segments] == [1, 2] and end["segments"] == 3
        assert all(s["source"] == "model" and s["state_file"] == ".harness_state.md" for s in segments)
        assert state_file.read_text() == STATE + "\n"
        after = next(e for e in evs[kinds.index("segment"):] if e["event"] == "request")
        assert after["segment"] == 1 and [m["role"] for m in after["messages"]][:2] == ["system", "user"]
        assert "assistant" not in [m["role"] for m in after["messages"]]
