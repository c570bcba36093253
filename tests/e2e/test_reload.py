"""Every hot-reloadable field takes effect in a running actor (one test per actor). In-process, real actors.

The supervisor's part (re-read, validate, diff, refuse fixed fields, hand each actor its section) is tested in
tests/core/test_runtime.py and, in a live run, in test_cli.py; here each actor's ``on_config`` must change what it
does next. ``[monitor] refresh_s`` is tested with the display (tests/monitor)."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from actors.collector import Collector, CollectorSettings
from actors.learner import LearnerActor, LearnerSettings
from actors.proxy import ProxyActor, ProxyActorSettings
from actors.scheduler import Scheduler
from actors.tree import TreeBuilder, TreeSettings
from pipeline.core.config import RunSection
from pipeline.core.paths import REPO
from pipeline.core.runtime import ActorContext
from pipeline.messages import TreeGroup
from pipeline.rollout.scheduling import SchedulerSettings, TaskSource
from pipeline.serving.factory import EngineSettings
from tests.helpers.live_actor import live
from tests.helpers.treegen import mc, settled

pytestmark = pytest.mark.anyio


def changed(cfg, **kw):
    return msgspec.structs.replace(cfg, **kw), kw


async def test_scheduler_sampling_bounds_and_staleness_apply_to_the_next_issue(tmp_path):
    c = SchedulerSettings(tasks=TaskSource(tasks="builtin:create_file", count=4), group_size=1,
                          max_groups_in_flight=1, temperature=1.0)
    ctx = ActorContext(run_dir=tmp_path, run=RunSection(steps=4, groups_per_step=2, max_staleness=0))
    actor = Scheduler("scheduler", c, ctx)
    async with live(actor) as lv:
        (first,) = await lv.wait_for("requests", 1)
        assert first.sampling.temperature == 1.0 and first.group_id == "g00000"
        new, kw = changed(c, temperature=0.5, top_p=0.9, top_k=5, max_new_tokens=17, timeout_s=9.0,
                          max_groups_in_flight=3)
        await actor.on_config(new, kw)
        (_, second) = await lv.wait_for("requests", 2)  # a raised bound lets step 0's second group out at once
        s = second.sampling
        assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens, second.timeout_s) == (0.5, 0.9, 5, 17, 9.0)
        await anyio.sleep(0.1)
        assert len(lv.sent["requests"]) == 2  # max_staleness 0: step 1 waits for the learner
        ctx.run = RunSection(steps=4, groups_per_step=2, max_staleness=1)
        await actor.on_run_config(ctx.run, {"max_staleness": 1})
        reqs = await lv.wait_for("requests", 3)  # one step ahead now; in-flight bound 3
        assert reqs[2].group_id == "g00002"
        await anyio.sleep(0.1)
        assert len(lv.sent["requests"]) == 3


async def test_collector_settle_rules_apply_to_rollouts_already_waiting():
    c = CollectorSettings(settle_checks=1000, settle_interval_s=0.01, settle_timeout_s=60.0)
    actor = Collector("collector", c)
    s = settled([mc(0, [1, 2], [3])], rid="r0")
    async with live(actor) as lv:
        for msg in (s.request, *s.calls, s.finished):
            await lv.inbox.send(msg)
        await anyio.sleep(0.2)
        assert lv.sent["settled"] == []  # 1000 quiet checks 10 ms apart: 10 s
        new, kw = changed(c, settle_checks=1)
        await actor.on_config(new, kw)
        with anyio.fail_after(2.0):
            (out,) = await lv.wait_for("settled", 1)
        assert out.request.rollout_id == "r0"


def two(rid0, rid1, leaves):
    """A group of two rollouts; the first makes ``leaves`` trained leaves (retries of its first call)."""
    a = settled([mc(i, [1, 2], [10 + i], call_id=f"c{i}") for i in range(leaves)], rid=rid0, index=0)
    b = settled([mc(0, [1, 2], [20])], rid=rid1, index=1)
    return [msgspec.structs.replace(r, request=msgspec.structs.replace(r.request, group_id=f"g-{rid0}"))
            for r in (a, b)]


async def test_tree_leaf_bound_applies_to_the_next_group():
    c = TreeSettings(max_leaves=2)
    actor = TreeBuilder("tree", c)
    async with live(actor) as lv:
        for r in two("a0", "a1", leaves=3):
            await lv.inbox.send(r)
        (dropped,) = await lv.wait_for("dropped", 1)  # one valid rollout of two: dropped
        new, kw = changed(c, max_leaves=8)
        await actor.on_config(new, kw)
        for r in two("b0", "b1", leaves=3):
            await lv.inbox.send(r)
        (group,) = await lv.wait_for("groups", 1)
        assert isinstance(group, TreeGroup) and len(group.rollouts) == 2 and dropped.group_id == "g-a0"


async def test_proxy_keepalive_and_update_timeout_apply_to_the_next_call():
    script = str(REPO / "configs" / "scripts" / "hello.json")
    c = ProxyActorSettings(unix_socket="", keepalive_s=5.0, engine=EngineSettings(kind="scripted", script=script))
    actor = ProxyActor("proxy", c)
    async with live(actor):
        with anyio.fail_after(10):
            await actor.ready.wait()
        new, kw = changed(c, keepalive_s=0.5, update_timeout_s=3.0)
        await actor.on_config(new, kw)
        assert actor.proxy.settings.keepalive_s == 0.5  # read by every call the proxy starts from now on
        assert actor.config.update_timeout_s == 3.0  # read at each weight update


async def test_learner_checkpoint_cadence_and_weights_kept_apply_at_the_next_step(tmp_path):
    actor = LearnerActor("learner", LearnerSettings(checkpoint_every=5, keep_weights=2),
                         ActorContext(run_dir=tmp_path, run=RunSection(model="unused", steps=9)))
    from pipeline.training.loop import LearnerLoop

    actor.loop = LearnerLoop(steps=9, groups_per_step=1, checkpoint_every=5)
    new, kw = changed(actor.config, checkpoint_every=1, keep_weights=1)
    await actor.on_config(new, kw)
    assert actor.loop.checkpoint_every == 1
    for v in range(3):
        (tmp_path / "weights" / f"v{v:05d}").mkdir(parents=True)
    actor._prune()
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["v00002"]


def test_every_reloadable_field_is_covered_here():
    """A field declared reloadable without a test here would be a promise nobody checked."""
    covered = {
        "scheduler": {"temperature", "max_new_tokens", "timeout_s", "max_groups_in_flight", "top_p", "top_k"},
        "collector": {"settle_checks", "settle_interval_s", "settle_timeout_s"},
        "tree": {"max_leaves", "include_aux"},
        "proxy": {"keepalive_s", "update_timeout_s"},
        "learner": {"checkpoint_every", "keep_weights"},
        "run": {"max_staleness"},
    }
    declared = {
        "scheduler": SchedulerSettings.reloadable, "collector": CollectorSettings.reloadable,
        "tree": TreeSettings.reloadable, "proxy": ProxyActorSettings.reloadable,
        "learner": LearnerSettings.reloadable, "run": RunSection.reloadable,
    }
    assert declared == covered
