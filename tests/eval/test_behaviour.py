"""Behavioural metrics on hand-made trajectories where every value is known."""

import pytest

from pipeline.eval.behaviour import behaviour
from pipeline.messages import (
    CallTrace,
    ModelCall,
    RolloutFinished,
    RolloutRequest,
    SettledRollout,
    ToolOutcome,
    ToolUse,
    pack_f32,
    pack_i32,
)

ROLES = {"write_file": "write", "edit_file": "edit", "read_file": "read", "bash": "shell"}
OFFERED = ["write_file", "read_file", "edit_file", "bash"]


def roles(_harness):
    return lambda name: ROLES.get(name, "other")


def call(seq, output="tool_calls", uses=(), outcomes=(), label="main", offered=OFFERED):
    return ModelCall(rollout_id="r", call_id=f"c{seq}", seq=seq, protocol="chat", label=label,
                     input_ids=pack_i32([1]), output_ids=pack_i32([2]), logprobs=pack_f32([0.0]),
                     trace=CallTrace(offered=list(offered), output=output, uses=list(uses), outcomes=list(outcomes)))


def use(name, **args):
    return ToolUse(name, args)


def rollout(rid, calls, reward=1.0, task="t1", status="ok"):
    req = RolloutRequest(rollout_id=rid, group_id="g", index=0, group_size=1, task_id=task, harness="h", token="x",
                         policy_version=0)
    return SettledRollout(request=req, finished=RolloutFinished(rollout_id=rid, group_id="g", status=status,
                                                                reward=reward), calls=calls)


def measure(rollouts, oracle=2):
    return behaviour(rollouts, roles, succeeded=lambda r: r.finished.reward >= 1.0, oracle_steps=lambda _t: oracle)


def test_a_clean_write_then_check_rollout():
    r = rollout("a", [
        call(0, uses=[use("write_file", path="out.txt", content="hi")]),
        call(1, uses=[use("read_file", path="./out.txt")]),
        call(2, output="answer"),
    ])
    b = measure([r])
    assert b.rollouts == 1 and b.calls == 3
    assert b.format_robustness.mean == 1.0
    assert b.self_verification.mean == 1.0
    assert b.tool_coverage.mean == pytest.approx(2 / 4)
    assert b.step_efficiency.mean == pytest.approx(2 / 3)
    assert b.error_recovery.mean is None  # no failed tool result: not measured, not 100 %
    assert b.values().keys() == {"format_robustness", "self_verification", "tool_coverage", "step_efficiency"}


def test_failures_of_each_kind():
    bad_format = rollout("b", [
        call(0, output="malformed"),
        call(1, uses=[use("browse", url="x")]),  # a tool that was not offered
        call(2, uses=[use("write_file", path="a.py", content="x")]),
        call(3, output="answer"),  # finished without checking what it wrote
        call(4, output="empty", label="subagent"),  # not the main agent: not counted
    ], reward=0.0)
    recovered = rollout("c", [
        call(0, uses=[use("bash", command="python a.py")]),
        call(1, uses=[use("bash", command="echo fixed > a.txt")], outcomes=[ToolOutcome("bash", True)]),
        call(2, uses=[use("bash", command="cat a.txt")]),  # a shell command after a shell write verifies
        call(3, output="answer"),
    ])
    b = measure([bad_format, recovered])
    assert b.calls == 4 + 4
    assert b.format_robustness.mean == pytest.approx(6 / 8)
    assert b.error_recovery.mean == 1.0 and b.error_recovery.n == 1
    assert b.self_verification.mean == pytest.approx(0.5) and b.self_verification.n == 2
    assert b.tool_coverage.mean == pytest.approx((1 / 4 + 1 / 4) / 2)  # "browse" was not offered
    assert b.step_efficiency.n == 1 and b.step_efficiency.mean == pytest.approx(2 / 4)


def test_reading_another_file_after_writing_is_not_verification():
    r = rollout("d", [
        call(0, uses=[use("write_file", path="a.txt", content="x")]),
        call(1, uses=[use("read_file", path="b.txt")]),
        call(2, output="answer"),
    ])
    assert measure([r]).self_verification.mean == 0.0


def test_a_rollout_without_traces_is_not_counted():
    old = rollout("e", [ModelCall(rollout_id="e", call_id="c", seq=0, protocol="chat", input_ids=b"",
                                  output_ids=b"", logprobs=b"")])
    b = measure([old])
    assert b.rollouts == 0 and b.calls == 0 and b.format_robustness.mean is None


def test_step_efficiency_is_capped_and_needs_an_oracle():
    r = rollout("f", [call(0, output="answer")])
    assert measure([r], oracle=3).step_efficiency.mean == 1.0
    assert measure([r], oracle=None).step_efficiency.mean is None


def test_tool_roles_follow_each_harness_and_the_white_box_t_level():
    from pipeline.eval.behaviour import tool_roles

    assert tool_roles("whitebox:S0T0O0C0W0")("write_file") == "write"
    assert tool_roles("whitebox:S1T2O0C0W0")("tool_k2") == "write"  # T2's opaque id for write_file
    assert tool_roles("whitebox:S1T2O0C0W0")("write_file") == "other"  # not offered under T2
    assert tool_roles("claude-code")("Edit") == "edit" and tool_roles("codex")("exec_command") == "shell"
    assert tool_roles("qwen-code")("run_shell_command") == "shell" and tool_roles("openclaw")("read") == "read"
