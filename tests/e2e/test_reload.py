"""Every hot-reloadable field takes effect in a running actor (one test per actor). In-process, real actors.

The supervisor's part (re-read, validate, diff, refuse fixed fields, hand each actor its section) is tested in
tests/core/test_runtime.py and, in a live run, in test_cli.py; here each actor runs, is handed a changed section
through its ``on_config`` (as the supervisor does), and what it does next must show the new value. Each test names
the fields it changes with ``@reloads``; the last test checks that together they cover every reloadable field every
actor declares, so a new reloadable field without a test here fails."""

from __future__ import annotations

import importlib
import inspect
import io
import json
import pkgutil
from typing import Any

import aiohttp
import anyio
import msgspec
import numpy as np
import pytest
from rich.console import Console
from structlog.testing import capture_logs

import actors
from actors.collector import Collector
from actors.evaluator import Evaluator
from actors.learner import LearnerActor, LearnerSettings
from actors.monitor import Monitor, MonitorSettings
from actors.proxy import ProxyActor
from actors.sandbox import SandboxPool, SandboxSettings
from actors.scheduler import Scheduler
from actors.toy import Scale, ScaleSettings, Sink, SinkSettings, Source, SourceSettings
from actors.tree import TreeBuilder, TreeSettings
from pipeline.core import logs
from pipeline.core.config import RunSection
from pipeline.core.runtime import Actor, ActorContext
from pipeline.eval.plan import EvalSettings
from pipeline.messages import (
    CallStarted,
    Metric,
    Note,
    PolicyUpdated,
    RolloutFinished,
    RolloutRequest,
    ServiceReady,
    TreeGroup,
    ids,
)
from pipeline.monitor.view import LiveView, LogView
from pipeline.rollout.scheduling import SchedulerSettings, TaskSource
from pipeline.serving.factory import EngineSettings
from pipeline.serving.proxy import ProxySettings
from pipeline.trees.collector import SettleSettings
from tests.helpers.learner_trees import group, random_paths, tiny_qwen3
from tests.helpers.live_actor import live
from tests.helpers.poll import until
from tests.helpers.treegen import mc, settled

pytestmark = pytest.mark.anyio

COVERED: dict[str, set[str]] = {}  # "module:Class" of an actor (or "run") -> the fields a test here changed


def reloads(owner: type[Actor[Any]] | str, *fields: str):
    """Mark a test as the one that shows ``fields`` of ``owner``'s section (an actor class, or "run") apply live."""
    key = owner if isinstance(owner, str) else f"{owner.__module__}:{owner.__qualname__}"
    COVERED.setdefault(key, set()).update(fields)
    return lambda test: test


def changed(cfg, **kw):
    return msgspec.structs.replace(cfg, **kw), kw


@reloads(Scheduler, "temperature", "top_p", "top_k", "max_new_tokens", "timeout_s", "max_groups_in_flight")
@reloads("run", "max_staleness")
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


def request(rid: str) -> RolloutRequest:
    return RolloutRequest(rollout_id=rid, group_id="g", index=0, group_size=1, task_id="t", harness="h",
                          token=f"tok-{rid}", policy_version=0)


@reloads(Collector, "settle_checks", "settle_interval_s", "settle_timeout_s")
async def test_collector_settle_rules_apply_to_rollouts_already_waiting():
    c = SettleSettings(settle_checks=1000, settle_interval_s=0.01, settle_timeout_s=60.0)
    actor = Collector("collector", c)
    s = settled([mc(0, [1, 2], [3])], rid="r0")
    async with live(actor) as lv:
        for msg in (s.request, *s.calls, s.finished):
            await lv.inbox.send(msg)
        await anyio.sleep(0.2)
        assert lv.sent["settled"] == []  # 1000 quiet checks 10 ms apart: 10 s
        c, kw = changed(c, settle_checks=1)
        await actor.on_config(c, kw)
        with anyio.fail_after(2.0):
            (out,) = await lv.wait_for("settled", 1)
        assert out.request.rollout_id == "r0" and out.settle == "quiet"

        # Checks 30 s apart: the first one after the rollout finished is 30 s away.
        c, kw = changed(c, settle_interval_s=30.0)
        await actor.on_config(c, kw)
        await lv.inbox.send(request("r1"))
        await lv.inbox.send(RolloutFinished(rollout_id="r1", group_id="g", status="ok"))
        await anyio.sleep(0.3)
        assert len(lv.sent["settled"]) == 1
        c, kw = changed(c, settle_interval_s=0.01)
        await actor.on_config(c, kw)
        with anyio.fail_after(2.0):
            (_, out) = await lv.wait_for("settled", 2)
        assert out.request.rollout_id == "r1" and out.settle == "quiet"

        # A call that never ends keeps a rollout from settling quietly; only the timeout settles it.
        await lv.inbox.send(request("r2"))
        await lv.inbox.send(CallStarted(rollout_id="r2", call_id="c0", seq=0, t=0.0))
        await lv.inbox.send(RolloutFinished(rollout_id="r2", group_id="g", status="ok"))
        await anyio.sleep(0.3)
        assert len(lv.sent["settled"]) == 2
        c, kw = changed(c, settle_timeout_s=0.2)
        await actor.on_config(c, kw)
        with anyio.fail_after(2.0):
            (_, _, out) = await lv.wait_for("settled", 3)
        assert out.request.rollout_id == "r2" and out.settle == "timeout" and out.aborted_calls == 1


def two(rid0, rid1, leaves):
    """A group of two rollouts; the first makes ``leaves`` trained leaves (retries of its first call)."""
    a = settled([mc(i, [1, 2], [10 + i], call_id=f"c{i}") for i in range(leaves)], rid=rid0, index=0)
    b = settled([mc(0, [1, 2], [20])], rid=rid1, index=1)
    return [msgspec.structs.replace(r, request=msgspec.structs.replace(r.request, group_id=f"g-{rid0}"))
            for r in (a, b)]


def with_subagent(gid):
    """A group of two rollouts, each a main call (one output token) and a subagent call (two output tokens)."""
    rs = [settled([mc(0, [1, 2], [10 + i]), mc(1, [5, 6], [30 + i, 40 + i], label="subagent", call_id="s1")],
                  rid=f"{gid}-{i}", index=i) for i in range(2)]
    return [msgspec.structs.replace(r, request=msgspec.structs.replace(r.request, group_id=gid)) for r in rs]


@reloads(TreeBuilder, "max_leaves", "include_aux")
async def test_tree_leaf_bound_and_aux_calls_apply_to_the_next_group():
    c = TreeSettings(max_leaves=2)
    actor = TreeBuilder("tree", c)
    async with live(actor) as lv:
        for r in two("a0", "a1", leaves=3):
            await lv.inbox.send(r)
        (dropped,) = await lv.wait_for("dropped", 1)  # one valid rollout of two: dropped
        c, kw = changed(c, max_leaves=8)
        await actor.on_config(c, kw)
        for r in two("b0", "b1", leaves=3):
            await lv.inbox.send(r)
        (group,) = await lv.wait_for("groups", 1)
        assert isinstance(group, TreeGroup) and len(group.rollouts) == 2 and dropped.group_id == "g-a0"

        def trained(g: TreeGroup) -> list[int]:
            t = g.packed
            return sorted(int(x) for x, m in zip(ids(t.tokens), np.frombuffer(t.trainable, np.uint8),
                                                 strict=True) if m)

        for r in with_subagent("main-only"):
            await lv.inbox.send(r)
        (_, main_only) = await lv.wait_for("groups", 2)
        c, kw = changed(c, include_aux=True)
        await actor.on_config(c, kw)
        for r in with_subagent("with-aux"):
            await lv.inbox.send(r)
        (_, _, with_aux) = await lv.wait_for("groups", 3)
        assert trained(main_only) == [10, 11]
        assert trained(with_aux) == [10, 11, 30, 31, 40, 41]


async def stream_events(base_url: str, token: str) -> list[str]:
    """One streamed Anthropic Messages call; the SSE event names it got, keep-alive pings included."""
    async with aiohttp.ClientSession() as s:
        r = await s.post(base_url + "/v1/messages", headers={"x-api-key": token}, json={
            "model": "policy", "max_tokens": 50, "stream": True, "messages": [{"role": "user", "content": "x"}]})
        text = await r.text()
    return [line[7:] for line in text.splitlines() if line.startswith("event: ")]


@reloads(ProxyActor, "keepalive_s", "update_timeout_s")
async def test_proxy_keepalive_applies_to_the_next_call_and_update_timeout_to_the_next_update(tmp_path):
    script = tmp_path / "slow.json"
    script.write_text(json.dumps({"default": [{"text": "Done."}], "latency_s": 0.6}))
    c = ProxySettings(unix_socket="", keepalive_s=5.0,
                           engine=EngineSettings(kind="scripted", script=str(script)))
    actor = ProxyActor("proxy", c)
    with pytest.RaisesGroup(TimeoutError, flatten_subgroups=True):
        async with live(actor) as lv:
            with anyio.fail_after(10):
                await actor.ready.wait()
            (ready,) = await lv.wait_for("rollouts", 1)
            assert isinstance(ready, ServiceReady)
            await lv.inbox.send(request("r0"))
            await lv.wait_for("rollouts", 2)  # registered, then forwarded
            assert "ping" not in await stream_events(actor.proxy.base_url, "tok-r0")  # 0.6 s < 5 s
            c, kw = changed(c, keepalive_s=0.1)
            await actor.on_config(c, kw)
            events = await stream_events(actor.proxy.base_url, "tok-r0")
            assert "ping" in events and events[-1] == "message_stop"

            # An engine that never finishes loading weights: the update fails after update_timeout_s.
            engine = actor.proxy.engine
            engine.update_weights = lambda path, version: anyio.sleep_forever()
            c, kw = changed(c, update_timeout_s=0.2)
            await actor.on_config(c, kw)
            with anyio.move_on_after(5):
                await lv.inbox.send(PolicyUpdated(version=1, step=1, weights_path=str(tmp_path / "w")))
                await lv.stopped.wait()  # never set: the actor's TimeoutError cancels this wait
            raise AssertionError("the weight update still waits after 5 s; update_timeout_s is 0.2")


class FakeBackend:
    """Holds every rollout until released; counts how many run at once. The pool's limiter is what is tested."""

    judge = None  # the pool closes a backend's judge client, if it has one

    def __init__(self) -> None:
        self.active = 0
        self.release = anyio.Event()

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    async def run(self, req, task, proxy_url, proxy_socket) -> RolloutFinished:
        self.active += 1
        try:
            await self.release.wait()
        finally:
            self.active -= 1
        return RolloutFinished(rollout_id=req.rollout_id, group_id=req.group_id, status="ok", reward=1.0)


@reloads(SandboxPool, "concurrency")
async def test_sandbox_concurrency_resizes_the_pool_under_waiting_rollouts(monkeypatch):
    backend = FakeBackend()
    monkeypatch.setattr("actors.sandbox.load_task", lambda path: path)
    c = SandboxSettings(concurrency=1)
    actor = SandboxPool("sandbox", c)
    monkeypatch.setattr(actor, "_backend", lambda run_id: backend)
    async with live(actor) as lv:
        await lv.inbox.send(ServiceReady(service="proxy", base_url="http://127.0.0.1:1"))
        for i in range(4):
            await lv.inbox.send(request(f"r{i}"))
        await anyio.sleep(0.2)
        assert backend.active == 1
        c, kw = changed(c, concurrency=3)
        await actor.on_config(c, kw)
        await until(lambda: backend.active >= 3, timeout_s=5.0)
        await anyio.sleep(0.1)
        assert backend.active == 3  # the fourth still waits
        backend.release.set()
        finished = await lv.wait_for("finished", 4)
        assert sorted(f.rollout_id for f in finished) == ["r0", "r1", "r2", "r3"]


@reloads(LearnerActor, "checkpoint_every", "keep_weights")
async def test_learner_checkpoint_cadence_and_weights_kept_apply_at_the_next_step(tmp_path):
    import torch

    model = tmp_path / "model"
    tiny_qwen3(3).save_pretrained(model)
    run_dir = tmp_path / "run"
    c = LearnerSettings(checkpoint_every=0, keep_weights=5, threads=1)
    actor = LearnerActor("learner", c, ActorContext(run_dir=run_dir,
                                                    run=RunSection(model=str(model), steps=4, groups_per_step=1)))
    rng = np.random.default_rng(0)
    threads = torch.get_num_threads()
    try:
        async with live(actor) as lv:
            for step in (1, 2):
                g = group(random_paths(rng, 2), [1.0, 0.0], gid=f"g{step}")
                await lv.inbox.send(msgspec.structs.replace(g, issued_version=step - 1))
                await lv.wait_for("updates", step, timeout_s=120)
            assert not (run_dir / "checkpoints").exists()  # 0: only after the last step
            assert len(list((run_dir / "weights").iterdir())) == 2
            c, kw = changed(c, checkpoint_every=1, keep_weights=1)
            await actor.on_config(c, kw)
            g = group(random_paths(rng, 2), [1.0, 0.0], gid="g3")
            await lv.inbox.send(msgspec.structs.replace(g, issued_version=2))
            (*_, third) = await lv.wait_for("updates", 3, timeout_s=120)
            assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step00003"]
            assert [str(p) for p in (run_dir / "weights").iterdir()] == [third.weights_path]
    finally:
        torch.set_num_threads(threads)


def monitor_in(tmp_path, config: MonitorSettings) -> Monitor:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    return Monitor("monitor", config, ActorContext(run_dir=run_dir))


@reloads(Monitor, "refresh_s")
async def test_monitor_refresh_s_redraws_the_live_display_at_the_new_rate(tmp_path, monkeypatch):
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120, color_system=None)
    monkeypatch.setattr(logs, "console", lambda: console)

    def frames() -> int:
        return buf.getvalue().count("bridle · run")

    c = MonitorSettings(display="auto", refresh_s=60.0, plots=False)
    actor = monitor_in(tmp_path, c)
    async with live(actor):
        await anyio.wait_all_tasks_blocked()
        assert isinstance(actor.view, LiveView)
        await anyio.sleep(0.6)
        slow = frames()
        assert slow <= 2  # the first frame (and at most one more): a 60 s refresh does not redraw
        c, kw = changed(c, refresh_s=0.05)
        await actor.on_config(c, kw)
        await anyio.sleep(0.6)
        fast = frames() - slow
        assert fast >= 5, f"{fast} redraws in 0.6 s at refresh_s 0.05"
        c, kw = changed(c, refresh_s=60.0)
        await actor.on_config(c, kw)
        await anyio.sleep(0.1)
        before = frames()
        await anyio.sleep(0.6)
        assert frames() - before == 0


@reloads(Monitor, "progress_s")
async def test_monitor_progress_s_spaces_the_progress_lines_at_the_new_interval(tmp_path, monkeypatch):
    monkeypatch.setattr(logs, "console", lambda: Console(file=io.StringIO(), force_terminal=False))
    c = MonitorSettings(display="log", refresh_s=0.02, progress_s=60.0, plots=False)
    actor = monitor_in(tmp_path, c)

    async def demonstrations(lv, n: int) -> None:
        for _ in range(n):
            await lv.inbox.send(Metric(source="sandbox", kind="demonstration", values={"reward": 1.0}))
            await anyio.sleep(0.06)  # three ticks: each demonstration is seen on its own

    with capture_logs() as cap:
        async with live(actor) as lv:
            await lv.inbox.send(Metric(source="scheduler", kind="scheduler",
                                       values={"steps_total": 1, "demonstrations_total": 100}))
            await demonstrations(lv, 5)
            assert isinstance(actor.view, LogView)
            slow = sum(e["event"] == "progress" for e in cap)
            assert slow == 1  # the phase change; then 60 s between lines
            c, kw = changed(c, progress_s=0.01)
            await actor.on_config(c, kw)
            await demonstrations(lv, 5)
            fast = sum(e["event"] == "progress" for e in cap) - slow
            assert fast >= 2, f"{fast} progress lines for 5 demonstrations at progress_s 0.01"


@reloads(Source, "interval_s")
@reloads(Scale, "factor")
@reloads(Sink, "delay_s")
async def test_toy_actors_interval_factor_and_delay_apply_to_the_next_note(tmp_path):
    c = SourceSettings(count=-1, interval_s=0.3)
    source = Source("source", c)
    async with live(source) as lv:
        await lv.wait_for("out", 1)
        await anyio.sleep(0.1)
        assert len(lv.sent["out"]) == 1
        c, kw = changed(c, interval_s=0.005)
        await source.on_config(c, kw)
        with anyio.fail_after(2.0):  # after the current 0.3 s wait, 5 ms apart (0.3 s apart: 6 s)
            await lv.wait_for("out", 20)

    c = ScaleSettings(factor=2.0)
    scale = Scale("scale", c)
    async with live(scale) as lv:
        await lv.inbox.send(Note(seq=1, value=1.0))
        await lv.wait_for("out", 1)
        c, kw = changed(c, factor=5.0)
        await scale.on_config(c, kw)
        await lv.inbox.send(Note(seq=2, value=1.0))
        assert [n.value for n in await lv.wait_for("out", 2)] == [2.0, 5.0]

    c = SinkSettings(path=str(tmp_path / "sink.jsonl"), delay_s=0.3)
    sink = Sink("sink", c)
    async with live(sink, inbox_size=0) as lv:  # unbuffered: a send completes when the sink takes the note
        await lv.inbox.send(Note(seq=0, value=0.0))
        with anyio.move_on_after(0.15) as waited:
            await lv.inbox.send(Note(seq=1, value=1.0))
        assert waited.cancelled_caught  # the sink sleeps 0.3 s after each note
        c, kw = changed(c, delay_s=0.0)
        await sink.on_config(c, kw)
        with anyio.fail_after(2.0):  # the current 0.3 s, then none (0.3 s each: 6 s)
            for i in range(1, 21):
                await lv.inbox.send(Note(seq=i, value=float(i)))
    assert len((tmp_path / "sink.jsonl").read_text().splitlines()) == 21


@reloads(Evaluator, "every_steps", "max_groups_in_flight")
async def test_evaluator_rounds_and_their_pace_apply_from_the_next_update(tmp_path):
    c = EvalSettings(tasks=TaskSource(tasks="builtin:create_file", count=3, seed=77), harnesses=["codex"],
                     samples=1, every_steps=0, max_groups_in_flight=1)
    actor = Evaluator("eval", c, ActorContext(run_dir=tmp_path, run=RunSection(steps=4, groups_per_step=1)))
    async with live(actor) as lv:
        await lv.inbox.send(PolicyUpdated(version=1, step=1))
        await anyio.sleep(0.3)
        assert lv.sent["requests"] == []  # every_steps = 0: no round during training
        c, kw = changed(c, every_steps=2)
        await actor.on_config(c, kw)
        await lv.inbox.send(PolicyUpdated(version=2, step=2))
        (first,) = await lv.wait_for("requests", 1)  # one group in flight at a time
        assert first.purpose == "eval" and first.eval.step == 2 and first.policy_version == 2
        await anyio.sleep(0.2)
        assert len(lv.sent["requests"]) == 1
        c, kw = changed(c, max_groups_in_flight=3)
        await actor.on_config(c, kw)
        reqs = await lv.wait_for("requests", 3)  # the raised bound lets the other two groups out at once
        assert len({r.group_id for r in reqs}) == 3


def test_every_reloadable_field_is_covered_here():
    """A field declared reloadable without a test here would be a promise nobody checked. Declared: every actor
    class in actors/ (by its Config's ``reloadable``), and the shared ``[run]`` section."""
    declared: dict[str, set[str]] = {"run": set(RunSection.reloadable)}
    for info in pkgutil.iter_modules(actors.__path__):
        mod = importlib.import_module(f"actors.{info.name}")
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if issubclass(cls, Actor) and cls.__module__ == mod.__name__ and cls.Config.reloadable:
                declared[f"{cls.__module__}:{cls.__qualname__}"] = set(cls.Config.reloadable)
    assert "actors.sandbox:SandboxPool" in declared and "actors.monitor:Monitor" in declared
    assert declared == COVERED
