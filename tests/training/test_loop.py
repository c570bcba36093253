"""The learner's bookkeeping (pipeline.training.loop), without a model: cold start, steps, staleness, checkpoints."""

import random

import pytest

from pipeline.messages import GroupDropped, PackedTree, TreeGroup
from pipeline.training.loop import ColdStartReady, LearnerLoop, StepReady, sft_plan

EMPTY = PackedTree(tokens=b"", positions=b"", subtree_end=b"", pred=b"", trainable=b"", logprobs=b"", rollout=b"",
                   segment=b"")


def group(gid, issued=0, purpose="train", packs=0):
    return TreeGroup(group_id=gid, task_id="t", harness="h", rollouts=[], packed=EMPTY, issued_version=issued,
                     purpose=purpose, packs=packs)


def drop(gid, purpose="train", packs=0):
    return GroupDropped(group_id=gid, reason="x", purpose=purpose, packs=packs)


def feed(loop, msgs, version=0, max_staleness=1):
    return [loop.receive(m, version=version, max_staleness=max_staleness) for m in msgs]


def test_steps_count_received_groups_trained_or_dropped():
    loop = LearnerLoop(steps=2, groups_per_step=2, checkpoint_every=0)
    out = feed(loop, [group("g0"), drop("g1"), group("g2"), group("g3")])
    assert out[0] is None and out[2] is None
    s1, s2 = out[1], out[3]
    assert isinstance(s1, StepReady) and s1.step == 1 and [g.group_id for g in s1.batch] == ["g0"]
    assert [g.group_id for g in s1.untrained] == ["g1"] and s2.untrained == []  # counted, for the step's report
    assert not s1.checkpoint and not s1.last  # checkpoint_every = 0: only at the end
    assert s2.step == 2 and [g.group_id for g in s2.batch] == ["g2", "g3"] and s2.checkpoint and s2.last
    assert loop.finished


def test_a_step_of_only_drops_is_still_a_step():
    loop = LearnerLoop(steps=3, groups_per_step=2)
    s = feed(loop, [drop("a"), drop("b")])[1]
    assert s.step == 1 and s.batch == [] and s.checkpoint  # checkpoint_every = 1


def test_stale_groups_are_left_out_and_reported():
    loop = LearnerLoop(steps=1, groups_per_step=3)
    out = feed(loop, [group("old", issued=3), group("ok", issued=5), group("new", issued=6)], version=6)
    s = out[-1]
    assert [g.group_id for g in s.batch] == ["ok", "new"] and s.stale == [("old", 3)]
    assert [g.group_id for g in s.untrained] == ["old"]


def test_checkpoint_cadence_and_a_live_change():
    loop = LearnerLoop(steps=6, groups_per_step=1, checkpoint_every=2)
    marks = [r.checkpoint for r in feed(loop, [group(f"g{i}") for i in range(3)])]
    assert marks == [False, True, False]
    loop.checkpoint_every = 1
    assert [r.checkpoint for r in feed(loop, [group("g3"), group("g4")])] == [True, True]


def test_cold_start_waits_for_every_announced_pack_trained_or_dropped():
    loop = LearnerLoop(steps=1, groups_per_step=1)
    out = feed(loop, [group("p0", purpose="sft", packs=3), drop("p1", purpose="sft", packs=3),
                      group("p2", purpose="sft", packs=3)])
    assert out[:2] == [None, None]
    ready = out[2]
    assert isinstance(ready, ColdStartReady) and [g.group_id for g in ready.packs] == ["p0", "p2"]
    assert ready.dropped == 1 and loop.cold_start_done
    assert loop.received == 0  # packs do not count towards RL steps


def test_no_rl_steps_is_a_cold_start_only_run():
    loop = LearnerLoop(steps=0, groups_per_step=2)
    assert not loop.finished  # the demonstrations are still to come
    ready = feed(loop, [group("p0", purpose="sft", packs=2), group("p1", purpose="sft", packs=2)])[1]
    assert isinstance(ready, ColdStartReady) and loop.finished


def test_packs_must_say_how_many_there_are_and_come_first():
    with pytest.raises(ValueError, match="how many packs"):
        feed(LearnerLoop(steps=1, groups_per_step=1), [group("p0", purpose="sft")])
    loop = LearnerLoop(steps=1, groups_per_step=1)
    feed(loop, [group("p0", purpose="sft", packs=1)])
    with pytest.raises(ValueError, match="after the cold start"):
        feed(loop, [group("p1", purpose="sft", packs=1)])


def test_resumed_loop_continues_at_the_first_unfinished_step():
    loop = LearnerLoop.resumed(steps=4, groups_per_step=2, checkpoint_every=1, steps_done=2)
    assert loop.cold_start_done and not loop.finished
    out = feed(loop, [group("a"), group("b")])
    assert out[1].step == 3
    done = LearnerLoop.resumed(steps=2, groups_per_step=2, checkpoint_every=1, steps_done=2)
    assert done.finished


def test_sft_plan_visits_every_pack_once_per_epoch_in_batches():
    packs = [group(f"p{i}", purpose="sft", packs=3) for i in range(3)]
    plan = sft_plan(packs, epochs=2, batch_groups=2, seed=0)
    assert [(u.epoch, len(u.packs)) for u in plan] == [(0, 2), (0, 1), (1, 2), (1, 1)]
    for epoch in (0, 1):
        seen = [g.group_id for u in plan if u.epoch == epoch for g in u.packs]
        assert sorted(seen) == ["p0", "p1", "p2"]
    ids = [[g.group_id for g in u.packs] for u in plan]
    assert ids == [[g.group_id for g in u.packs] for u in sft_plan(packs, epochs=2, batch_groups=2, seed=0)]
    orders = {tuple(g.group_id for u in sft_plan(packs, epochs=1, batch_groups=3, seed=s) for g in u.packs)
              for s in range(20)}
    assert len(orders) > 1  # shuffled, by the seed
    assert sft_plan([], epochs=3, batch_groups=2, seed=0) == []


def test_sft_plan_shuffles_each_epoch_with_one_generator():
    """The order a replay of an older run reproduces: random.Random(seed), one shuffle of the packs per epoch."""
    packs = [group(f"p{i}", purpose="sft", packs=5) for i in range(5)]
    rng = random.Random(7)
    want = []
    for epoch in range(3):
        order = [g.group_id for g in packs]
        rng.shuffle(order)
        want += [(epoch, order[i:i + 2]) for i in range(0, 5, 2)]
    got = [(u.epoch, [g.group_id for g in u.packs]) for u in sft_plan(packs, epochs=3, batch_groups=2, seed=7)]
    assert got == want


def spread_group(gid, resample=0, issued=0):
    return TreeGroup(group_id=gid, task_id="t", harness="h", rollouts=[], packed=EMPTY, issued_version=issued,
                     resample=resample)


def test_dynamic_sampling_replaces_flat_groups_up_to_the_bound_and_counts_the_rest():
    """Bound 2: a flat group (no reward spread) is replaced twice in its slot, then its third is counted (and
    trained, flat: the health report says so); groups with a spread, dropped and stale ones count as before."""
    from pipeline.training.loop import Resample

    loop = LearnerLoop(steps=2, groups_per_step=2, dynamic_sampling=2)

    def rx(g, spread, version=0):
        return loop.receive(g, version=version, max_staleness=1, spread=spread)

    r = rx(spread_group("g0"), spread=False)
    assert isinstance(r, Resample) and r.next == 1 and loop.received == 0
    assert rx(spread_group("g1"), spread=True) is None
    r = rx(spread_group("g0-x1", resample=1), spread=False)
    assert isinstance(r, Resample) and r.next == 2
    s1 = rx(spread_group("g0-x2", resample=2), spread=False)  # the bound is spent: counted
    assert isinstance(s1, StepReady) and s1.step == 1
    assert [g.group_id for g in s1.batch] == ["g1", "g0-x2"]
    assert [g.group_id for g in s1.resampled] == ["g0", "g0-x1"]
    # step 2: a stale flat group is counted as stale (a replacement would be no fresher), a drop counts
    assert rx(spread_group("g2", issued=0), spread=False, version=5) is None
    s2 = rx(drop("g3"), spread=True)
    assert isinstance(s2, StepReady) and s2.resampled == [] and [g for g, _ in s2.stale] == ["g2"]
    # off (the default): a flat group is trained as before
    off = LearnerLoop(steps=1, groups_per_step=1)
    assert isinstance(off.receive(spread_group("g0"), version=0, max_staleness=1, spread=False), StepReady)
