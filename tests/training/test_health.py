"""Could an RL step learn? (pipeline.training.health): the counts per step, hand-checked, and the one warning line."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from actors.learner import LearnerActor, LearnerSettings
from pipeline.core.config import RunSection
from pipeline.core.runtime import ActorContext
from pipeline.messages import GroupDropped, LeftOut, PackedTree, RolloutSummary, TreeGroup
from pipeline.training.health import assess
from tests.helpers.learner_trees import group as tree_group
from tests.helpers.learner_trees import random_paths, tiny_qwen3
from tests.helpers.live_actor import live

EMPTY = PackedTree(tokens=b"", positions=b"", subtree_end=b"", pred=b"", trainable=b"", logprobs=b"", rollout=b"",
                   segment=b"")


def group(gid, rewards, statuses=None, left_out=(), task="t0", issued=0):
    statuses = statuses or ["ok"] * len(rewards)
    return TreeGroup(group_id=gid, task_id=task, harness="codex", packed=EMPTY, issued_version=issued,
                     rollouts=[RolloutSummary(rollout_id=f"{gid}-{i}", reward=r, status=s)
                               for i, (r, s) in enumerate(zip(rewards, statuses, strict=True))],
                     left_out=list(left_out))


def failed(rid, status="harness_error", exit_code=None, reason=None):
    return LeftOut(rollout_id=rid, status=status, reason=reason or f"status {status}", exit_code=exit_code)


def dropped(gid, left_out, task="t0"):
    return GroupDropped(group_id=gid, reason="0 valid rollouts of 2, need 2", task_id=task, harness="codex",
                        left_out=list(left_out))


def test_zero_variance_groups_hand_checked():
    # [0, 0] and [1, 1] have no spread, [0, 1] has: 2 of 3
    h = assess(1, [group("a", [0.0, 0.0]), group("b", [1.0, 1.0]), group("c", [0.0, 1.0])], [])
    assert (h.groups, h.zero_variance) == (3, 2)
    v = h.values()
    assert v["zero_var_groups"] == 2 and v["zero_var_frac"] == pytest.approx(2 / 3)
    assert v["rollouts"] == 6 and v["rollouts_ok"] == 6 and v["rollouts_harness_error"] == 0
    assert (v["rollouts_trained"], v["rollouts_left_out"], v["groups_dropped"], v["stale_groups"]) == (6, 0, 0, 0)
    assert h.warning() is None  # one group with a spread is a gradient


def test_a_step_without_reward_spread_warns_in_one_line():
    h = assess(3, [group("a", [0.0] * 4), group("b", [0.0] * 4)], [])
    assert h.cause == "no_reward_spread" and h.values()["zero_var_frac"] == 1.0
    assert h.warning() == ("step 3: no reward spread in 2/2 groups (all rewards 0.0): the policy gradient is zero; "
                           "rollouts: 8 ok")
    h = assess(3, [group("a", [0.0, 0.0]), group("b", [1.0, 1.0])], [])
    assert h.warning() == ("step 3: no reward spread in 2/2 groups (each group's rollouts scored alike): the policy "
                           "gradient is zero; rollouts: 4 ok")
    assert "value baseline" in h.warning(advantage="ppo")  # PPO's advantage is R - V: not zero, but no signal


def test_a_step_whose_every_rollout_failed_names_the_first_reasons():
    h = assess(2, [], [dropped("a", [failed("a0", exit_code=1), failed("a1", exit_code=1)]),
                       dropped("b", [failed("b0", exit_code=137), failed("b1", exit_code=1)], task="t1")])
    assert h.cause == "no_successful_rollout"
    assert h.warning() == ("step 2: no successful rollout: 4 harness_error; left out: 3x harness_error, exit code 1 "
                           "(first: task t0, codex); 1x harness_error, exit code 137 (first: task t1, codex); the "
                           "policy is unchanged")
    v = h.values()
    # nothing was trained: no zero-variance fraction (n/a), never 0 % or 100 %
    assert "zero_var_frac" not in v and "zero_var_groups" not in v
    assert (v["groups"], v["groups_dropped"], v["rollouts"], v["rollouts_ok"], v["rollouts_harness_error"]) == (
        0, 2, 4, 0, 4)
    assert (v["rollouts_trained"], v["rollouts_left_out"]) == (0, 4)


def test_rollouts_left_out_of_trained_groups_are_counted_and_named():
    g = group("a", [0.0, 0.0], left_out=[failed("a2", "timeout"), failed("a3", "ok", reason="no usable calls")])
    h = assess(4, [g], [dropped("b", [failed("b0", "sandbox_error"), LeftOut(rollout_id="b1", status="ok",
                                                                             reason="group dropped")])])
    v = h.values()
    assert (v["rollouts"], v["rollouts_ok"], v["rollouts_timeout"], v["rollouts_sandbox_error"]) == (6, 4, 1, 1)
    assert (v["rollouts_trained"], v["rollouts_left_out"], v["groups_dropped"]) == (2, 4, 1)
    # the usable rollout of the dropped group is left out but is no failure of its own
    assert [f.what for f in h.failures.values()] == ["timeout", "no usable calls", "sandbox_error"]
    assert h.warning() == ("step 4: no reward spread in 1/1 groups (all rewards 0.0): the policy gradient is zero; "
                           "rollouts: 4 ok, 1 timeout, 1 sandbox_error; left out: 1x timeout (first: task t0, codex); "
                           "1x no usable calls (first: task t0, codex); 1x sandbox_error (first: task t0, codex)")


def test_only_the_first_kinds_of_failure_are_named():
    kinds = ["timeout", "sandbox_error", "harness_error", "verifier_error"]
    h = assess(1, [], [dropped(f"g{i}", [failed(f"r{i}", k)]) for i, k in enumerate(kinds)])
    assert h.warning().endswith("; 1 more kind; the policy is unchanged")


def test_stale_groups_and_statuses_outside_train_statuses_are_left_out():
    stale = group("s", [1.0, 0.0])
    trained = group("a", [1.0, 0.0, 1.0], statuses=["ok", "ok", "timeout"])
    h = assess(5, [trained], [stale], train_statuses=["ok"])
    v = h.values()
    assert (v["stale_groups"], v["rollouts"], v["rollouts_trained"], v["rollouts_left_out"]) == (1, 5, 2, 3)
    assert v["zero_var_groups"] == 0 and h.warning() is None
    assert {f.what: f.count for f in h.failures.values()} == {"timeout (not in train_statuses)": 1,
                                                              "group too stale": 2}
    h = assess(6, [], [stale])
    assert h.warning() == ("step 6: nothing trained: 1 too stale; rollouts: 2 ok; left out: 2x group too stale "
                           "(first: task t0, codex); the policy is unchanged")


def test_groups_recorded_before_they_listed_their_rollouts():
    old = GroupDropped(group_id="g", reason="0 valid rollouts of 2, need 2")  # an event log of an older bridle
    h = assess(1, [], [old, old])
    assert "rollouts" not in h.values()  # unknown, not 0
    assert h.warning() == ("step 1: nothing trained: 2 groups dropped by the tree builder; rollouts: n/a (the "
                           "step's groups list none); the policy is unchanged")


# ---------------------------------------------------------------------------------------------- the actor
@pytest.mark.anyio
async def test_the_learner_actor_warns_when_a_step_cannot_learn(tmp_path):
    """Uniform rewards, then a step whose every rollout failed: each step logs one warning line, and its Metric
    carries the line and the counts (what metrics.jsonl and the display show)."""
    model = tmp_path / "model"
    tiny_qwen3(3).save_pretrained(model)
    actor = LearnerActor("learner", LearnerSettings(checkpoint_every=0, threads=1), ActorContext(
        run_dir=tmp_path / "run", run=RunSection(model=str(model), steps=2, groups_per_step=2)))
    rng = np.random.default_rng(0)
    threads = torch.get_num_threads()
    try:
        with capture_logs() as cap:
            async with live(actor) as lv:
                for gid in ("a", "b"):
                    await lv.inbox.send(tree_group(random_paths(rng, 3), [0.0, 0.0, 0.0], gid=gid))
                for gid in ("c", "d"):
                    await lv.inbox.send(GroupDropped(
                        group_id=gid, reason="0 valid rollouts of 2, need 2", task_id="t", harness="h",
                        left_out=[failed(f"{gid}{i}", exit_code=1) for i in range(2)]))
                first, second = await lv.wait_for("metrics", 2, timeout_s=120)
                with anyio.fail_after(120):
                    await lv.stopped.wait()  # the last step ends the actor
    finally:
        torch.set_num_threads(threads)
    flat = ("step 1: no reward spread in 2/2 groups (all rewards 0.0): the policy gradient is zero; "
            "rollouts: 6 ok")
    failing = ("step 2: no successful rollout: 4 harness_error; left out: 4x harness_error, exit code 1 "
               "(first: task t, h); the policy is unchanged")
    warned = [(e["event"], e["step"], e["cause"]) for e in cap if e["log_level"] == "warning"]
    assert warned == [(flat, 1, "no_reward_spread"), (failing, 2, "no_successful_rollout")]
    assert first.warnings == [flat] and second.warnings == [failing]
    assert first.values["zero_var_frac"] == 1.0 and first.values["rollouts_ok"] == 6 and "loss" in first.values
    assert "zero_var_frac" not in second.values and second.values["rollouts_harness_error"] == 4
    assert second.values["groups"] == 0 and second.values["groups_dropped"] == 2


def test_replaced_groups_are_counted_and_named_in_the_warning():
    h = assess(2, [group("a", [0.0, 0.0])], [], resampled=[group("b", [0.0, 0.0]), group("c", [1.0, 1.0])])
    assert h.values()["groups_resampled"] == 2 and h.cause == "no_reward_spread"
    assert h.warning().endswith("; 2 groups already replaced (dynamic sampling)")
    assert "groups_resampled" not in assess(2, [group("a", [0.0, 1.0])], []).values()  # off: not a count of 0


@pytest.mark.anyio
async def test_the_learner_actor_asks_for_a_replacement_of_a_flat_group(tmp_path):
    """[run].dynamic_sampling = 1: a group without a reward spread is not trained or counted; the actor sends
    GroupResample for its slot's next group; the replacement, flat too, is past the bound and counted."""
    import msgspec

    model = tmp_path / "model"
    tiny_qwen3(3).save_pretrained(model)
    actor = LearnerActor("learner", LearnerSettings(checkpoint_every=0, threads=1), ActorContext(
        run_dir=tmp_path / "run", run=RunSection(model=str(model), steps=1, groups_per_step=2, dynamic_sampling=1)))
    rng = np.random.default_rng(0)
    threads = torch.get_num_threads()
    try:
        async with live(actor) as lv:
            await lv.inbox.send(tree_group(random_paths(rng, 3), [0.0, 0.0, 0.0], gid="a"))
            (ask,) = await lv.wait_for("resample", 1, timeout_s=60)
            assert (ask.group_id, ask.resample) == ("a", 1)
            await lv.inbox.send(tree_group(random_paths(rng, 3), [0.0, 1.0, 0.0], gid="b"))
            flat = msgspec.structs.replace(tree_group(random_paths(rng, 3), [1.0, 1.0, 1.0], gid="a-x1"), resample=1)
            await lv.inbox.send(flat)
            (metric,) = await lv.wait_for("metrics", 1, timeout_s=120)
            with anyio.fail_after(120):
                await lv.stopped.wait()
    finally:
        torch.set_num_threads(threads)
    assert metric.values["groups"] == 2 and metric.values["groups_resampled"] == 1
    assert metric.values["zero_var_groups"] == 1 and metric.warnings == []
