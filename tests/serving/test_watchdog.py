"""The engine watchdog: a dead engine fails the run at once (pipeline/serving/watchdog.py)."""

import subprocess
import sys
import time

import anyio
import pytest

from pipeline.serving.engine import EngineProcess
from pipeline.serving.watchdog import EngineDied, watch_engine

pytestmark = pytest.mark.anyio


class Launched:
    def __init__(self, *processes: EngineProcess):
        self.processes = list(processes)


class Attached:
    def __init__(self, answers):
        self.answers = list(answers)
        self.base_url = "http://127.0.0.1:1"

    async def health(self):
        return self.answers.pop(0) if self.answers else False


async def test_a_launched_engine_that_exits_is_reported_with_code_and_log(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("loading...\nCUDA error: out of memory\n")
    proc = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(0.3); sys.exit(3)"])  # noqa: ASYNC220 — the watchdog polls a Popen, as the launcher hands it one
    t0 = time.monotonic()
    with pytest.raises(EngineDied, match=r"exited with code 3(.|\n)*out of memory"):
        with anyio.fail_after(10):
            await watch_engine(Launched(EngineProcess("engine", proc, log)), interval_s=0.05)
    assert time.monotonic() - t0 < 2.0


async def test_one_dead_worker_of_several_is_named(tmp_path):
    """Two workers and the router in front of them: the second worker's death is reported as its own."""
    logs = [tmp_path / f"{n}.log" for n in ("router", "w0", "w1")]
    for log in logs:
        log.write_text(f"{log.stem} started\n")
    logs[2].write_text("w1: Killed\n")
    live = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) for _ in range(2)]  # noqa: ASYNC220 — as the launcher hands them over
    dead = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(0.3); sys.exit(9)"])  # noqa: ASYNC220
    engine = Launched(EngineProcess("router", live[0], logs[0]), EngineProcess("engine", live[1], logs[1]),
                      EngineProcess("engine 1", dead, logs[2]))
    try:
        with pytest.raises(EngineDied, match=r"the engine 1 process \(pid \d+\) exited with code 9(.|\n)*w1\.log"
                                             r"(.|\n)*w1: Killed"):
            with anyio.fail_after(10):
                await watch_engine(engine, interval_s=0.05)
    finally:
        for p in live:
            p.kill()
            p.wait()


async def test_an_attached_engine_fails_after_consecutive_missed_probes():
    with pytest.raises(EngineDied, match="failed 3 health probes in a row"):
        with anyio.fail_after(5):
            await watch_engine(Attached([True, False, True, False, False, False]), interval_s=0.01, failures=3)


async def test_a_healthy_engine_is_watched_until_cancelled():
    with anyio.move_on_after(0.3) as scope:
        await watch_engine(Attached([True] * 1000), interval_s=0.01)
    assert scope.cancelled_caught
