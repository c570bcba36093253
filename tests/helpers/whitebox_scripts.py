"""Scripted white-box episodes shared by the end-to-end tests (local sandboxes in test_whitebox_proxy.py, Docker in
test_whitebox_docker.py): the per-rollout script for a configuration and the checks of the finished episode.

The harness is started with context budgets of one character and a progress check every turn, so C1/C2 manage the
context after every tool turn and W2 checks progress after every tool turn: short episodes reach every mechanism.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import msgspec

from harness_images.whitebox.agent.components import SYSTEM_PROMPTS
from pipeline.messages import CallFailed, ModelCall, RolloutFinished, RolloutRequest
from pipeline.rollout.harness_space import HarnessConfig, offered_tools, tool_name_for
from pipeline.rollout.tasks import Task
from pipeline.serving.scripted import ScriptCall, ScriptResponse

HARNESS_ARGS = ["--summary-budget-chars", "1", "--compaction-budget-chars", "1", "--verify-every", "1",
                "--api-retries", "0"]  # no retries: a retry would advance the script and hide the failure
PLAN = "1. Write the file. 2. Read it back. 3. Report."
STATE = "Wrote the file; still to do: read it back and report."
DONE = "Done: the file holds the requested text."


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


def scripted_request(config: HarnessConfig, task: Task, steps: list[tuple[str, ScriptResponse]]) -> RolloutRequest:
    """The rollout of ``config`` on ``task`` that plays ``steps`` (RolloutRequest.script)."""
    rid = f"wb-{config.name}"
    return RolloutRequest(
        rollout_id=rid, group_id=rid, index=0, group_size=1, task_id=task.id,
        harness=f"whitebox:{config.name}", token=f"tok-{config.name}", policy_version=0,
        timeout_s=120.0, script=[msgspec.to_builtins(r) for _, r in steps],
    )


def check_outcome(out: Outcome, config: HarnessConfig) -> None:
    """The episode scored 1, the proxy saw the scripted calls, and the transcript shows every realization."""
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
    assert start["system_prompt"] == SYSTEM_PROMPTS[config.s]
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
