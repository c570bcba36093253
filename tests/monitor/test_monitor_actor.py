"""The monitor actor: metrics.jsonl with kinds, progress log lines off a terminal. (Its reloadable fields apply
live: tests/e2e/test_reload.py.)"""

import io
import json

import anyio
import pytest
from rich.console import Console
from structlog.testing import capture_logs

from actors.monitor import Monitor, MonitorSettings
from pipeline.core import logs
from pipeline.core.runtime import ActorContext
from pipeline.messages import Metric, Note
from pipeline.monitor.state import MonitorState, absorb
from pipeline.monitor.view import LiveView, LogView, open_view

pytestmark = pytest.mark.anyio

TITLE = "bridle · run"


def terminal() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=True, width=120, color_system=None), buf


async def drive(tmp_path, config, script):
    """Run a Monitor on ``tmp_path/run`` while ``script(monitor, send)`` feeds it; returns the monitor."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    m = Monitor("monitor", config, ActorContext(run_dir=run_dir))
    send, m.inbox = anyio.create_memory_object_stream(100)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(m.run)
            await anyio.wait_all_tasks_blocked()  # run() has opened its view and waits for messages
            await script(m, send)
            await send.aclose()
    return m


async def test_metrics_jsonl_has_kind_and_source_and_the_state_follows_kinds(tmp_path):
    async def script(m, send):
        await send.send(Metric(source="sched", kind="scheduler", values={"steps_total": 2, "demonstrations_total": 0}))
        await send.send(Metric(source="trainer", kind="rl_step", step=1, values={"reward": 0.5, "entropy": 0.2}))
        await send.send(Note(value="ignored"))
        await send.send(Metric(source="trainer", kind="rl_step", step=2, values={"reward": 0.7, "entropy": 0.1}))

    m = await drive(tmp_path, MonitorSettings(display="off", plots=True), script)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["source"], r["kind"], r["step"]) for r in rows] == [
        ("sched", "scheduler", -1), ("trainer", "rl_step", 1), ("trainer", "rl_step", 2)]
    assert m.state.rl_steps_done == 2 and m.state.rl_rewards == [0.5, 0.7]  # "trainer" is not a known actor name
    assert (tmp_path / "run" / "plots.png").exists()  # plots select on the kind too


async def test_off_a_terminal_progress_lines_and_a_line_per_step(tmp_path, monkeypatch):
    console = Console(file=io.StringIO(), force_terminal=False)
    monkeypatch.setattr(logs, "console", lambda: console)

    async def script(m, send):
        assert isinstance(m.view, LogView)
        await send.send(Metric(source="s", kind="scheduler", values={"steps_total": 1, "demonstrations_total": 2}))
        for _ in range(2):
            await send.send(Metric(source="sb", kind="demonstration", values={"reward": 1.0}))
        await anyio.sleep(0.3)
        await send.send(Metric(source="l", kind="rl_step", step=1, values={"reward": 0.25, "loss": 0.5}))
        await anyio.sleep(0.3)

    with capture_logs() as cap:
        await drive(tmp_path, MonitorSettings(display="auto", refresh_s=0.05, plots=False), script)
    progress = [e for e in cap if e["event"] == "progress"]
    phases = [e["phase"] for e in progress]
    # A loaded machine may tick between the sends, so a "recording" line can come first; the order is what matters.
    order = ["cold start: recording demonstrations", "cold start: SFT on the demonstrations", "done"]
    assert phases == sorted(phases, key=order.index) and phases[-1] == "done", phases
    sft = next(e for e in progress if e["phase"] == order[1])
    assert sft["demonstrations"].startswith("2/2 (done in")
    assert progress[-1]["RL_steps"].startswith("1/1 (done in")
    steps = [e for e in cap if e["event"] == "step"]
    assert steps == [{"event": "step", "step": 1, "reward": 0.25, "loss": 0.5, "actor": "monitor",
                      "log_level": "info"}]


class Recorder:
    def __init__(self):
        self.lines = []

    def info(self, event, **fields):
        self.lines.append((event, fields))


def test_log_view_speaks_on_phase_changes_and_at_most_every_progress_s():
    s = MonitorState(run_name="run", t0=0.0)
    log = Recorder()
    v = LogView(log, every_s=30.0)
    v.start(s, 0.0)
    v.tick(s, 1.0)
    assert log.lines == []  # nothing happened yet
    absorb(s, Metric(source="s", kind="scheduler", values={"demonstrations_total": 10, "steps_total": 2}), 2.0)
    v.tick(s, 2.0)
    assert [f["phase"] for _, f in log.lines] == ["cold start: recording demonstrations"]
    for t in range(3, 8):
        absorb(s, Metric(source="sb", kind="demonstration"), float(t))
        v.tick(s, float(t))
    assert len(log.lines) == 1  # progress, but within 30 s of the last line
    v.tick(s, 33.0)
    assert len(log.lines) == 2 and log.lines[-1][1]["demonstrations"].startswith("5/10")
    v.tick(s, 70.0)
    assert len(log.lines) == 2  # no progress: no line
    v.every_s = 1.0  # [monitor].progress_s changed
    absorb(s, Metric(source="sb", kind="demonstration"), 71.0)
    v.tick(s, 72.0)
    assert len(log.lines) == 3
    absorb(s, Metric(source="sb", kind="demonstration"), 72.5)
    v.close(s, 72.6)  # the last state is always said
    assert len(log.lines) == 4 and log.lines[-1][1]["demonstrations"].startswith("7/10")


def test_open_view():
    tty, _ = terminal()
    pipe = Console(file=io.StringIO(), force_terminal=False)
    log = Recorder()
    assert isinstance(open_view("auto", tty, log, 30.0), LiveView)
    assert isinstance(open_view("auto", pipe, log, 30.0), LogView)
    assert isinstance(open_view("log", tty, log, 30.0), LogView)
    assert open_view("off", tty, log, 30.0) is None


def test_refresh_s_must_be_positive():
    import msgspec

    with pytest.raises(msgspec.ValidationError, match="refresh_s"):
        msgspec.convert({"refresh_s": 0}, MonitorSettings)
