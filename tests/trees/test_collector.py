"""Settling: when a rollout's records are complete."""

from pipeline.messages import (
    CallFailed,
    CallStarted,
    ModelCall,
    RolloutFinished,
    RolloutRequest,
    pack_f32,
    pack_i32,
)
from pipeline.trees.collector import Settler, SettleSettings

REQ = RolloutRequest(rollout_id="r", group_id="g", index=0, group_size=1, task_id="t", harness="h", token="x",
                     policy_version=0)


def call(cid, seq):
    return ModelCall(rollout_id="r", call_id=cid, seq=seq, protocol="chat", input_ids=pack_i32([1, 2]),
                     output_ids=pack_i32([3]), logprobs=pack_f32([-0.1]))


def fin():
    return RolloutFinished(rollout_id="r", group_id="g", status="ok", reward=1.0)


def run_ticks(s, start, end, step=0.1):
    out = []
    for i in range(round((end - start) / step) + 1):
        t = round(start + i * step, 6)
        out += [(t, x) for x in s.tick(t)]
    return out


def test_settles_after_n_quiet_checks():
    s = Settler(SettleSettings(settle_checks=3, settle_interval_s=1.0, settle_timeout_s=100))
    s.add(REQ, 0)
    s.add(CallStarted(rollout_id="r", call_id="a", seq=0, t=0), 0)
    s.add(call("a", 0), 1)
    assert s.tick(5) == []  # not finished yet
    s.add(fin(), 10)
    got = run_ticks(s, 10, 20)
    assert len(got) == 1
    t, settled = got[0]
    assert t == 13.0  # quiet checks at 11, 12, 13
    assert settled.settle == "quiet" and [c.call_id for c in settled.calls] == ["a"]


def test_record_after_harness_exit_inside_the_window_is_included():
    s = Settler(SettleSettings(settle_checks=2, settle_interval_s=1.0, settle_timeout_s=100))
    s.add(REQ, 0)
    s.add(call("a", 0), 1)
    s.add(fin(), 10)
    assert s.tick(11) == []  # one quiet check
    # a background retry arrives after the harness exited
    s.add(CallStarted(rollout_id="r", call_id="b", seq=1, t=11.5), 11.5)
    assert s.tick(12) == []  # pending call: never settled while something is in flight
    s.add(call("b", 1), 12.5)
    assert s.tick(13) == []  # still counting from the change
    assert s.tick(14) == []
    (settled,) = s.tick(15)
    assert [c.call_id for c in settled.calls] == ["a", "b"]


def test_call_that_never_finishes_is_cut_at_the_timeout_and_reported():
    s = Settler(SettleSettings(settle_checks=2, settle_interval_s=1.0, settle_timeout_s=30))
    s.add(REQ, 0)
    s.add(call("a", 0), 1)
    s.add(CallStarted(rollout_id="r", call_id="hung", seq=1, t=2), 2)
    s.add(fin(), 10)
    assert run_ticks(s, 10, 39, 1.0) == []
    assert s.pending_calls("r") == {"hung"}
    (settled,) = s.tick(40)
    assert settled.settle == "timeout" and settled.aborted_calls == 1
    assert [c.call_id for c in settled.calls] == ["a"] and s.stats.timed_out == 1


def test_duplicates_failed_calls_and_late_records():
    s = Settler(SettleSettings(settle_checks=1, settle_interval_s=1.0, settle_timeout_s=30))
    s.add(REQ, 0)
    s.add(call("a", 0), 1)
    s.add(call("a", 0), 1.1)
    s.add(CallStarted(rollout_id="r", call_id="f", seq=1, t=2), 2)
    s.add(CallFailed(rollout_id="r", call_id="f", seq=1, reason="engine 500", t=3), 3)
    s.add(fin(), 10)
    assert s.tick(10.5) == []  # not a check yet (interval 1 s)
    (settled,) = s.tick(11)
    assert len(settled.calls) == 1 and [f.reason for f in settled.failed_calls] == ["engine 500"]
    assert s.stats.duplicates == 1
    s.add(call("late", 2), 13)
    assert s.stats.late_records == 1 and "r" not in s.rollouts


def test_finished_without_request_is_an_orphan():
    s = Settler(SettleSettings(settle_checks=1, settle_interval_s=1.0, settle_timeout_s=30))
    s.add(fin(), 0)
    assert s.tick(5) == [] and s.stats.orphans == 1
