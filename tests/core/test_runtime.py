"""Actor runtime: wiring, back-pressure, crashes, replay, hot reload (in-process)."""

import json
import tracemalloc

import anyio
import anyio.lowlevel
import pytest

from actors import REGISTRY
from pipeline.cli import launch
from pipeline.core import config as cfg
from pipeline.core.eventlog import EventLogReader
from pipeline.core.runtime import Actor, ActorCrashed, Supervisor, make_resolver
from pipeline.messages import ActorStopped, ConfigChanged, Note

resolve = make_resolver(REGISTRY)
pytestmark = pytest.mark.anyio


def toy(tmp_path, count=20, extra=None, **sink):
    sink_path = tmp_path / "sink.jsonl"
    d = {
        "experiment": {"name": "toy", "runs_dir": str(tmp_path / "runs")},
        "graph": {
            "actors": {"source": "actors.toy:Source", "scale": "actors.toy:Scale", "sink": "actors.toy:Sink"},
            "edges": ["source.out -> scale", "scale.out -> sink"],
            "queue_size": 4,
        },
        "source": {"count": count},
        "scale": {"factor": 3.0},
        "sink": {"path": str(sink_path), **sink},
    }
    for k, v in (extra or {}).items():
        d.setdefault(k, {}).update(v)
    return cfg.load_experiment(d, resolve), sink_path


def read_sink(p):
    return [json.loads(line) for line in p.read_text().splitlines()]


async def test_finite_graph_drains_and_stops(tmp_path):
    exp, sink = toy(tmp_path)
    rd = launch.make_run_dir(exp, tmp_path / "run")
    await launch.run_experiment(exp, resolve, rd, handle_signals=False)
    assert read_sink(sink) == [{"seq": i, "value": 3.0 * i} for i in range(20)]
    evs = list(EventLogReader(rd.events))
    notes = [e for e in evs if isinstance(e.msg, Note)]
    assert len(notes) == 40
    assert {e.src for e in notes} == {"source.out", "scale.out"}
    stopped = {e.msg.actor: e.msg.reason for e in evs if isinstance(e.msg, ActorStopped)}
    assert stopped == {"source": "done", "scale": "done", "sink": "done"}


class Producer(Actor):
    outputs = ("out",)
    Config = cfg.Section
    produced = 0

    async def run(self):
        for i in range(10_000):
            await self.send("out", Note(seq=i, value="x" * 1000))
            Producer.produced = i + 1


class SlowConsumer(Actor):
    Config = cfg.Section
    consumed = 0
    max_lead = 0

    async def run(self):
        async for _msg in self.messages():
            SlowConsumer.consumed += 1
            SlowConsumer.max_lead = max(SlowConsumer.max_lead, Producer.produced - SlowConsumer.consumed)
            if SlowConsumer.consumed >= 300:
                SlowConsumer.produced_at_stop = Producer.produced
                return
            await anyio.lowlevel.checkpoint()
            await anyio.lowlevel.checkpoint()


async def test_backpressure_blocks_a_fast_producer_and_memory_stays_bounded(tmp_path):
    exp = cfg.load_experiment(
        {"graph": {"actors": {"p": f"{__name__}:Producer", "c": f"{__name__}:SlowConsumer"},
                   "edges": ["p.out -> c"], "queue_size": 5}},
        make_resolver({}),
    )
    tracemalloc.start()
    sup = Supervisor(exp, make_resolver({}), None, handle_signals=False)
    await sup.run()
    _cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # the producer can never be more than the inbox size (+ the one message in flight) ahead
    assert SlowConsumer.max_lead <= 5 + 1
    # when the consumer stopped, at most a queue-full more had been produced
    assert SlowConsumer.produced_at_stop <= 300 + 5 + 1
    assert peak < 5_000_000  # 10k x 1 KB messages would be > 10 MB if buffered


async def test_actor_exception_stops_the_graph_and_is_reported(tmp_path):
    exp, _ = toy(tmp_path, count=-1, fail_at=7)  # an endless source: only the crash can stop it
    rd = launch.make_run_dir(exp, tmp_path / "run")
    with pytest.raises(ActorCrashed) as e:
        await launch.run_experiment(exp, resolve, rd, handle_signals=False)
    assert e.value.actor == "sink"
    assert isinstance(e.value.error, RuntimeError) and "fail at seq 7" in str(e.value.error)
    evs = list(EventLogReader(rd.events))
    stopped = {ev.msg.actor: ev.msg for ev in evs if isinstance(ev.msg, ActorStopped)}
    assert stopped["sink"].reason == "crashed" and "fail at seq 7" in stopped["sink"].error
    assert stopped["source"].reason == "cancelled" and stopped["scale"].reason == "cancelled"


async def test_replay_of_recorded_run_gives_the_same_downstream_output(tmp_path):
    exp, sink = toy(tmp_path, count=50)
    rd = launch.make_run_dir(exp, tmp_path / "live")
    await launch.run_experiment(exp, resolve, rd, handle_signals=False)
    live = read_sink(sink)

    for stage in ({"scale", "sink"}, {"sink"}):
        replay_sink = tmp_path / f"replay-{len(stage)}.jsonl"
        rexp = launch.recorded_experiment(rd.events, resolve, [f'sink.path="{replay_sink}"'])
        rrd = launch.make_run_dir(rexp, tmp_path / f"replay{len(stage)}")
        await launch.replay_stage(rd.events, rexp, resolve, stage, rrd)
        assert read_sink(replay_sink) == live
        srcs = {e.src for e in EventLogReader(rrd.events) if isinstance(e.msg, Note)}
        assert srcs == ({"scale.out"} if "scale" in stage else set())
        assert EventLogReader(rrd.events).header.replay_of == str(rd.events)


async def test_replay_applies_recorded_config_changes_in_order(tmp_path):
    exp, _ = toy(tmp_path, count=10)
    cfg_path = tmp_path / "exp.toml"
    cfg_path.write_text(exp.to_toml())
    exp = cfg.load_experiment(cfg_path, resolve)
    rd = launch.make_run_dir(exp, tmp_path / "live")
    log = launch.open_event_log(rd, exp)
    # Live: only "scale" runs; we play the source by hand so the reload lands exactly between notes 4 and 5.
    sup = Supervisor(exp, resolve, log, handle_signals=False, only={"scale"}, external_inputs={"scale"})
    sup.config_path = cfg_path
    # a tap on scale's output: the feeder waits for each note to come out before sending the next
    tap_send, tap = anyio.create_memory_object_stream[Note](1)
    sup.actors["scale"].out["out"].connect(tap_send)

    async def feeder(graph):
        for i in range(10):
            if i == 5:
                cfg_path.write_text(cfg_path.read_text().replace("factor = 3.0", "factor = 5.0"))
                assert await sup.reload()
            note = Note(seq=i, value=i)
            await log.record("source.out", note)
            await graph.feeds["scale"].send(note)
            with anyio.fail_after(10):
                assert (await tap.receive()).seq == i

    with tap:
        await sup.run(feeder)
    log.close()

    def outputs(path):
        return [e.msg.value for e in EventLogReader(path) if e.src == "scale.out"]

    live = outputs(rd.events)
    assert live == [0, 3, 6, 9, 12, 25, 30, 35, 40, 45]
    changes = [e.msg for e in EventLogReader(rd.events) if isinstance(e.msg, ConfigChanged)]
    assert changes == [ConfigChanged(section="scale", changes={"factor": 5.0})]

    rexp = launch.recorded_experiment(rd.events, resolve)
    assert rexp.sections["scale"].factor == 3.0  # the replay starts from the config the run started with
    rrd = launch.make_run_dir(rexp, tmp_path / "replay")
    await launch.replay_stage(rd.events, rexp, resolve, {"scale"}, rrd)
    assert outputs(rrd.events) == live


async def test_reload_refuses_fixed_fields_and_invalid_files(tmp_path):
    exp, _ = toy(tmp_path)
    p = tmp_path / "exp.toml"
    p.write_text(exp.to_toml())
    exp = cfg.load_experiment(p, resolve)
    sup = Supervisor(exp, resolve, None, config_path=p, handle_signals=False)
    scale = sup.actors["scale"]
    told = []  # every actor hears of every reload, applied or not (the monitor's trackers record them)

    async def heard(change):
        told.append((change.section, change.accepted))

    scale.on_reload = heard
    text = p.read_text()
    p.write_text(text.replace("factor = 3.0", 'factor = 9.0\nmode = "add"'))
    assert not await sup.reload()
    assert scale.config.factor == 3.0 and scale.config.mode == "mul"  # nothing half-applied
    p.write_text(text.replace("factor = 3.0", 'factor = "x"'))
    assert not await sup.reload()
    p.write_text(text.replace("factor = 3.0", "factor = 9.0"))
    assert await sup.reload()
    assert scale.config.factor == 9.0 and sup.refusals == 2 and sup.reloads == 1
    assert told == [("*", False), ("*", False), ("scale", True)]


async def test_concurrent_sends_to_a_finished_receiver_do_not_crash():
    # The scheduler returns after issuing its last group while many sandbox tasks still report to it.
    from pipeline.core.runtime import Output

    out = Output("sandbox.finished", None)
    send, recv = anyio.create_memory_object_stream(0)
    other_send, other_recv = anyio.create_memory_object_stream(100)
    out.connect(other_send)  # the open edge first: every task yields there before it meets the closed one
    out.connect(send)
    await recv.aclose()
    async with anyio.create_task_group() as tg:
        for i in range(20):
            tg.start_soon(out.send, Note(seq=i))
    assert other_recv.statistics().current_buffer_used == 20


def test_processes_run_on_uvloop_unless_told_otherwise(monkeypatch):
    from pipeline.core.runtime import EVENT_LOOP_ENV, event_loop_name, run_main

    async def _loop_module() -> str:
        return event_loop_name()

    monkeypatch.delenv(EVENT_LOOP_ENV, raising=False)
    assert run_main(_loop_module) == "uvloop"
    monkeypatch.setenv(EVENT_LOOP_ENV, "asyncio")
    assert run_main(_loop_module) == "asyncio"
    monkeypatch.setenv(EVENT_LOOP_ENV, "trio")
    with pytest.raises(SystemExit, match="BRIDLE_EVENT_LOOP='trio': use 'uvloop' or 'asyncio'"):
        run_main(_loop_module)
