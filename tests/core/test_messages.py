"""Every message type round-trips through msgpack and JSON, arrays included."""

import msgspec
import numpy as np
import pytest

from pipeline import messages as m

SAMPLES = [
    m.RolloutRequest(
        rollout_id="r1", group_id="g1", index=1, group_size=4, task_id="t", harness="whitebox:S0T1O2C1W0",
        token="secret", policy_version=3, sampling=m.SamplingParams(temperature=0.7, seed=5), timeout_s=30.0,
        purpose="eval",
    ),
    m.ServiceReady(service="proxy", base_url="http://127.0.0.1:1", unix_socket="/tmp/s"),
    m.EngineReady(servers=["http://127.0.0.1:2", "http://127.0.0.1:3"], weight_version=2),
    m.CallStarted(rollout_id="r1", call_id="c1", seq=0, t=1.5),
    m.ModelCall(
        rollout_id="r1", call_id="c1", seq=0, protocol="anthropic", label="compaction",
        input_ids=m.pack_i32(np.arange(8192)), output_ids=m.pack_i32([151644, 0, -1, 2**31 - 1]),
        logprobs=m.pack_f32([-0.1, -2.5, 0.0, -30.0]), versions=[m.VersionSpan(0, 3), m.VersionSpan(2, 4)],
        finish_reason="tool_calls", spliced_turns=2, rendered_turns=1, model="policy",
        timings=m.CallTimings(received=1.0, engine_start=1.1, engine_end=2.0, sent=2.01, render_s=0.001),
    ),
    m.CallFailed(rollout_id="r1", call_id="c2", seq=1, reason="client disconnected", t=3.0),
    m.RolloutFinished(
        rollout_id="r1", group_id="g1", status="verifier_error", reward=0.5, rewards={"rule": 1.0, "rubric": 0.0},
        exit_code=1, details="boom", timings=m.RolloutTimings(queued=1, sandbox_ready=2, harness_done=3, verified=4),
    ),
    m.TreeGroup(
        group_id="g1", task_id="t", harness="codex",
        rollouts=[m.RolloutSummary(rollout_id="r1", reward=1.0, status="ok",
                                   stats=m.TreeStats(calls=3, dropped={"dead_leaf": 1}), policy_version=2)],
        packed=m.PackedTree(
            tokens=m.pack_i32([1, 2, 3]), positions=m.pack_i32([0, 1, 2]), subtree_end=m.pack_i32([3, 3, 3]),
            pred=m.pack_i32([-1, 0, 1]), trainable=m.pack_u8([0, 1, 1]), logprobs=m.pack_f32([0, -1, -2]),
            rollout=m.pack_i32([-1, 0, 0]), segment=m.pack_i32([0, 0, 0]),
        ),
        issued_version=2,
        left_out=[m.LeftOut(rollout_id="r2", status="harness_error", reason="status harness_error", exit_code=1)],
    ),
    m.GroupDropped(group_id="g1", reason="fewer than 2 valid rollouts", valid_rollouts=1, task_id="t",
                   harness="codex", left_out=[m.LeftOut(rollout_id="r1", status="ok", reason="group dropped")]),
    m.PolicyUpdated(version=4, step=3, weights_path="/w", metrics={"loss": 0.5}),
    m.PolicyUpdated(version=5, step=4, pushed=True),
    m.GroupResample(group_id="g00003", resample=1),
    m.ConfigChanged(section="scale", changes={"factor": 3.0, "names": ["a"]}, accepted=False, reason="fixed"),
    m.Metric(source="learner", step=2, values={"reward": 0.25}, t=9.0, warnings=["step 2: nothing trained"]),
    m.ActorStopped(actor="sink", reason="crashed", error="RuntimeError: x"),
    m.Note(value={"nested": [1, 2.5, "x", None]}, seq=7),
]


def sample(t):
    return next(s for s in SAMPLES if isinstance(s, t))


def test_samples_cover_every_message_type():
    assert {type(s) for s in SAMPLES} | {m.SettledRollout} == set(m.MESSAGE_TYPES)


def _settled():
    return m.SettledRollout(
        request=sample(m.RolloutRequest), finished=sample(m.RolloutFinished), calls=[sample(m.ModelCall)],
        failed_calls=[sample(m.CallFailed)], settle="timeout",
        aborted_calls=1,
    )


@pytest.mark.parametrize("msg", SAMPLES + [_settled()], ids=lambda x: type(x).__name__)
def test_round_trip_msgpack_and_json(msg):
    ev = m.Event(t=123.25, src="a.out", msg=msg)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(ev), type=m.Event) == ev
    assert msgspec.json.decode(msgspec.json.encode(ev), type=m.Event) == ev
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=m.Message) == msg


def test_arrays_are_compact_and_exact():
    call = sample(m.ModelCall)
    assert len(call.input_ids) == 8192 * 4
    assert m.ids(call.input_ids).tolist() == list(range(8192))
    assert m.ids(call.output_ids).tolist() == [151644, 0, -1, 2**31 - 1]
    assert m.floats(call.logprobs).tolist() == pytest.approx([-0.1, -2.5, 0.0, -30.0])
    assert m.mask(sample(m.TreeGroup).packed.trainable).tolist() == [False, True, True]
    # 8k ids + framing stay close to the raw array size
    assert len(msgspec.msgpack.encode(call)) < 8192 * 4 + 400


def test_tag_is_the_class_name():
    assert msgspec.json.decode(msgspec.json.encode(sample(m.PolicyUpdated)))["type"] == "PolicyUpdated"


def test_sampling_seeds_are_stable_distinct_and_engine_sized():
    from pipeline.messages import sampling_seed

    seeds = [sampling_seed(0, f"g00000-r{i}") for i in range(64)]
    assert len(set(seeds)) == 64 and all(0 <= s < 2**31 for s in seeds)
    assert sampling_seed(0, "g00000-r0") == seeds[0] != sampling_seed(1, "g00000-r0")
