"""Earlier runs' rollouts as cold-start demonstrations: which are kept (rejection sampling), renamed, counted."""

import pytest

from pipeline.core.eventlog import EventLogWriter, LogHeader
from pipeline.core.recordings import Recordings, recorded_rollouts, select_demonstrations, with_total
from pipeline.messages import (
    SCHEMA_VERSION,
    ModelCall,
    RolloutFinished,
    RolloutRequest,
    SettledRollout,
    pack_f32,
    pack_i32,
)


def call(rid, seq=0, label="main"):
    return ModelCall(rollout_id=rid, call_id=f"{rid}-c{seq}", seq=seq, protocol="chat", label=label,
                     input_ids=pack_i32([1, 2, 3]), output_ids=pack_i32([4, 5]), logprobs=pack_f32([-0.5, -0.25]))


def settled(rid, status="ok", reward=1.0, labels=("main",)):
    req = RolloutRequest(rollout_id=rid, group_id="g0", index=3, group_size=8, task_id="t", harness="codex",
                         token="x", policy_version=2, purpose="eval")
    return SettledRollout(request=req, finished=RolloutFinished(rollout_id=rid, group_id="g0", status=status,
                                                                reward=reward),
                          calls=[call(rid, i, label) for i, label in enumerate(labels)])


def write_log(path, msgs):
    header = LogHeader(schema_version=SCHEMA_VERSION, run_id="r", created=0.0, experiment="t", config={})
    with EventLogWriter(path, header) as w:
        for i, m in enumerate(msgs):
            w.append("collector.settled" if isinstance(m, SettledRollout) else "proxy.calls", m, t=float(i))
    return str(path)


def test_only_verified_successes_are_kept_renamed_as_demonstrations(tmp_path):
    log = write_log(tmp_path / "events.msgpack", [
        settled("a"), settled("b", reward=0.0), settled("c", status="timeout", reward=1.0),
        settled("d", reward=0.5), settled("e", labels=("subagent",)), settled("f", labels=("main", "main")),
        call("served"),  # a --serve recording: calls, no verdict
    ])
    sel = select_demonstrations(Recordings(logs=[log]))
    assert sel.seen == 7
    assert [len(s.calls) for s in sel.rollouts] == [1, 2]  # a and f
    assert sel.left_out == {"reward below 1": 2, "status timeout": 1, "no model call": 1,
                            "no verdict (unverified = false)": 1}
    first = sel.rollouts[0]
    assert first.request.rollout_id == first.request.group_id == first.finished.rollout_id == "rec00000"
    assert {c.rollout_id for c in sel.rollouts[1].calls} == {"rec00001"}
    assert (first.request.purpose, first.request.group_size, first.request.index) == ("sft", 1, 0)
    assert first.request.harness == "codex" and first.finished.reward == 1.0


def test_threshold_unverified_and_the_same_log_twice(tmp_path):
    log = write_log(tmp_path / "events.msgpack", [settled("a"), settled("d", reward=0.5), call("served")])
    sel = select_demonstrations(Recordings(logs=[log, log], min_reward=0.5, unverified=True))
    assert len(sel.rollouts) == 6 and sel.left_out == {}
    assert len({s.request.rollout_id for s in sel.rollouts}) == 6  # never two demonstrations with one id
    assert [s.request.demonstrations for s in with_total(sel.rollouts, 10)] == [10] * 6


def test_a_cut_log_still_reads_its_calls_and_verdicts(tmp_path):
    fin = RolloutFinished(rollout_id="r", group_id="g", status="ok", reward=1.0)
    log = write_log(tmp_path / "events.msgpack", [call("r"), fin])
    (rec,) = recorded_rollouts(tmp_path / "events.msgpack")
    assert (rec.settled, rec.verified) == (False, True)
    assert len(select_demonstrations(Recordings(logs=[log])).rollouts) == 1


@pytest.mark.parametrize(("logs", "why"), [([], "logs is empty"), (["/nonexistent/events.msgpack"], "no such file")])
def test_recordings_name_what_is_wrong(logs, why):
    assert why in Recordings(logs=logs).problem()
