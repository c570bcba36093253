"""The real sglang-router, started as its own process, in front of small stand-in SGLang workers (aiohttp servers in
this process that answer what the router and the client ask): it spreads generations, a weight update reaches
every worker, a dead router or worker fails the run, a killed bridle leaves no router behind. The same with real
embedded engines: tests/serving/test_router_embedded.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
from aiohttp import web

from pipeline.serving import router
from pipeline.serving.engine import EngineSampling
from pipeline.serving.factory import EngineSettings, engine_problem, engine_threads
from pipeline.serving.launch import free_port
from pipeline.serving.router import INSTALL, RouterSettings, launch_router_over, router_available
from pipeline.serving.watchdog import EngineDied, watch_engine
from tests.helpers.ci import require

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[2]


def needs_router() -> None:
    require(router_available(), f"sglang-router is not installed ({INSTALL})")


class Worker:
    """An SGLang server as far as the router and the client look: its output token is its own index."""

    def __init__(self, index: int) -> None:
        self.index, self.version, self.generated, self.seen = index, "0", 0, []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.seen.append(path)
        if path == "/health":
            return web.Response()
        if path in ("/model_info", "/get_model_info"):
            return web.json_response({"model_path": "/m", "weight_version": self.version})
        if path in ("/server_info", "/get_server_info"):
            return web.json_response({})
        body = await request.json() if request.can_read_body else {}
        if path == "/generate":
            self.generated += 1
            return web.json_response({"text": "", "output_ids": [self.index], "meta_info": {
                "id": body["rid"], "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 2,
                "weight_version": self.version, "weight_versions": [{"version": self.version, "start": 0, "end": 1}],
                "output_token_logprobs": [[-0.5, self.index, None]]}})
        if path == "/update_weights_from_disk":
            self.version = body["weight_version"]
            return web.json_response({"success": True, "message": "ok"})
        return web.Response(status=404)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


async def workers(n: int) -> list[Worker]:
    out = [Worker(i) for i in range(n)]
    for w in out:
        await w.start()
    return out


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def test_generation_spreads_and_updates_reach_every_worker(tmp_path):
    needs_router()
    ws = await workers(2)
    try:
        settings = RouterSettings(policy="round_robin")
        async with launch_router_over([w.url for w in ws], settings, log_path=tmp_path / "engine.log") as eng:
            assert eng.control_urls == [w.url for w in ws] and eng.base_url not in eng.control_urls
            outs = [(await eng.generate([1, 2], EngineSampling(max_new_tokens=1))).output_ids[0] for _ in range(6)]
            await eng.update_weights("/ckpt/step_5", 5)
            after = [await eng.generate([1, 2], EngineSampling(max_new_tokens=1)) for _ in range(2)]
            info = await eng.model_info()
    finally:
        for w in ws:
            await w.stop()
    assert sorted(outs) == [0, 0, 0, 1, 1, 1] and [w.generated for w in ws] == [4, 4]  # round robin, 3 + 1 each
    # the update went to each worker directly, not through the router; both now answer with version 5
    assert [w.version for w in ws] == ["5", "5"] and info["weight_version"] == "5"
    assert all("/update_weights_from_disk" in w.seen for w in ws)
    assert sorted(r.output_ids[0] for r in after) == [0, 1] and all(r.version_spans == [(0, "5")] for r in after)
    # the router asked each worker what it asks at registration
    assert all({"/health", "/server_info", "/model_info"} <= set(w.seen) for w in ws)
    assert (tmp_path / "engine-router.log").exists()


async def test_a_killed_router_fails_the_run_with_its_signal(tmp_path):
    needs_router()
    ws = await workers(2)
    try:
        async with launch_router_over([w.url for w in ws], RouterSettings(), log_path=tmp_path / "e.log") as eng:
            [router] = [p for p in eng.processes if p.name == "router"]
            [real] = children(router.process.pid)  # the router under its guard
            os.kill(real, signal.SIGKILL)
            with pytest.raises(EngineDied, match=r"the router process \(pid \d+\) exited with code -9(.|\n)*e-router"):
                with anyio.fail_after(20):
                    await watch_engine(eng, interval_s=0.05)
    finally:
        for w in ws:
            await w.stop()


async def test_a_dead_worker_behind_a_launched_router_fails_the_run(tmp_path):
    """Servers bridle did not start are watched by /health: the router alone would only mark one unhealthy."""
    needs_router()
    ws = await workers(2)
    try:
        async with launch_router_over([w.url for w in ws], RouterSettings(), log_path=tmp_path / "e.log") as eng:
            await ws[1].stop()
            with pytest.raises(EngineDied, match="or one of its workers"):
                with anyio.fail_after(30):
                    await watch_engine(eng, interval_s=0.05, failures=3)
    finally:
        for w in ws:
            await w.stop()


async def test_a_worker_the_router_cannot_reach_is_named(tmp_path):
    needs_router()
    ws = await workers(1)
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        with pytest.raises(TimeoutError, match=rf"did not route to \['{dead}'\] within 3s"):
            async with router.launch_router([ws[0].url, dead], RouterSettings(timeout_s=3),
                                            log_path=tmp_path / "router.log"):
                pass
    finally:
        await ws[0].stop()
    assert "ERROR" not in (tmp_path / "router.log").read_text()  # waiting for the workers logs no error


def test_a_killed_bridle_leaves_no_router_behind():
    """The guard stops the router when whoever started it is gone (the router cannot notice by itself)."""
    code = ("import subprocess, sys, time; g = subprocess.Popen([sys.executable, '-m', "
            "'pipeline.serving.router_guard', 'sleep', '600']); print(g.pid, flush=True); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        guard = int(parent.stdout.readline())  # type: ignore[union-attr]
        deadline = time.monotonic() + 20
        while not children(guard):
            assert time.monotonic() < deadline, "the guard did not start its child"
            time.sleep(0.05)
        [child] = children(guard)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 20
        while alive(guard) or alive(child):
            assert time.monotonic() < deadline, "the guarded process outlived the run that started it"
            time.sleep(0.1)
    finally:
        os.killpg(parent.pid, signal.SIGKILL)


def test_the_guard_ends_as_its_child_ended():
    def guarded(code: str) -> int:
        return subprocess.run([sys.executable, "-m", "pipeline.serving.router_guard", sys.executable, "-c", code],
                              cwd=ROOT, timeout=60, check=False).returncode

    assert guarded("import sys; sys.exit(3)") == 3
    assert guarded("import os, signal; os.kill(os.getpid(), signal.SIGKILL)") == -signal.SIGKILL
    assert guarded("pass") == 0


def test_a_missing_router_package_is_named(monkeypatch):
    monkeypatch.setattr(router, "router_available", lambda: False)

    async def main():
        async with router.launch_router(["http://127.0.0.1:1"], RouterSettings()):
            pass

    with pytest.raises(RuntimeError, match=r"sglang-router .* not installed: pip install -e '\.\[router\]'"):
        anyio.run(main)


def test_router_command_line():
    cmd = router.router_command(["http://a:1", "http://b:2"], host="127.0.0.1", port=5, prometheus_port=6,
                                policy="round_robin", extra_args=["--health-check-interval-secs", "5"])
    assert cmd[1:3] == ["-m", "pipeline.serving.router_guard"] and cmd[4:6] == ["-m", "sglang_router.launch_router"]
    assert cmd[cmd.index("--worker-urls") + 1: cmd.index("--policy")] == ["http://a:1", "http://b:2"]
    assert "--disable-retries" in cmd and cmd[cmd.index("--prometheus-port") + 1] == "6"
    assert cmd[-2:] == ["--health-check-interval-secs", "5"]
    assert RouterSettings().resolved_policy() == "cache_aware"
    assert RouterSettings(policy="random").resolved_policy() == "random"


def test_router_flags_are_the_installed_routers():
    """Every flag bridle passes is one the installed launch_router accepts (its --help, a real process), and the
    installed router is the release pyproject.toml pins and router.py was checked against."""
    needs_router()
    import importlib.metadata
    import tomllib

    assert importlib.metadata.version("sglang-router") == router.ROUTER_VERSION
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pin = f"sglang-router=={router.ROUTER_VERSION}"
    assert extras["router"] == [pin] and pin in extras["test"]
    out = subprocess.run([sys.executable, "-m", "sglang_router.launch_router", "--help"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    cmd = router.router_command(["http://a:1"], host="h", port=1, prometheus_port=2, policy="cache_aware")
    flags = {a for a in cmd[cmd.index("sglang_router.launch_router"):] if a.startswith("--")}
    assert {f for f in flags if f not in out} == set()
    for policy in ("round_robin", "cache_aware", "random"):
        assert policy in out


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        (EngineSettings(kind="sglang", replicas=2), "list running SGLang servers in [engine].server_urls"),
        (EngineSettings(kind="scripted", replicas=2), '[engine].replicas is read by kind = "embedded" only'),
        (EngineSettings(kind="embedded", server_urls=["http://a:1"]), '[engine].server_urls is read by kind = "sglang"'),
    ],
)
def test_fleet_settings_that_cannot_work_are_refused(settings, needle):
    assert needle in engine_problem(settings)
    assert engine_problem(EngineSettings(kind="embedded", replicas=3)) == ""
    assert engine_problem(EngineSettings(kind="sglang", server_urls=["http://a:1", "http://b:2"])) == ""


def test_replicas_share_out_half_the_cores(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert [engine_threads(n) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]


def test_replicas_and_router_settings_read_from_toml():
    import msgspec

    raw = {"kind": "embedded", "replicas": 2, "router": {"policy": "random", "args": ["--cache-threshold", "0.5"]}}
    s = msgspec.convert(json.loads(json.dumps(raw)), EngineSettings)
    assert s.replicas == 2 and s.router.policy == "random" and s.router.args == ["--cache-threshold", "0.5"]
    with pytest.raises(msgspec.ValidationError, match="replicas"):
        msgspec.convert({"replicas": 0}, EngineSettings)
    with pytest.raises(msgspec.ValidationError, match="policy"):
        msgspec.convert({"router": {"policy": "power_of_two"}}, EngineSettings)
