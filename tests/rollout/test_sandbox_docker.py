"""The Docker sandbox backend against a real Docker engine and the images from pipeline/images.py.

Skipped on a machine without Docker; required in CI (harness_images/ci_setup.sh starts dockerd and builds images).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import uuid
from functools import partial
from pathlib import Path

import anyio
import msgspec
import pytest

from pipeline.messages import RolloutRequest
from pipeline.rollout.harnesses import HARNESSES
from pipeline.rollout.sandbox import DockerBackend, DockerSettings
from pipeline.rollout.sandbox.base import SandboxCommon
from pipeline.rollout.sandbox.docker import COMPILE_CACHE, LABEL
from pipeline.rollout.scheduling import oracle_script
from pipeline.rollout.taskgen import family_names, generate
from pipeline.rollout.tasks import Task, materialize
from pipeline.serving.scripted import Script, ScriptCall, ScriptResponse
from tests.helpers.ci import require
from tests.helpers.docker import OFFLINE, containers_of
from tests.helpers.poll import until
from tests.helpers.proxyutil import running_proxy

pytestmark = [pytest.mark.anyio, pytest.mark.docker]
SEEDS = (0, 1)


def request(harness: str, task: Task, timeout_s: float = 120.0, rid: str = "r1") -> RolloutRequest:
    return RolloutRequest(rollout_id=rid, group_id="g", index=0, group_size=1, task_id=task.id, harness=harness,
                          token="tok", policy_version=0, timeout_s=timeout_s)


def cache_files(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder``: (size, mtime in ns)."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


def variant(tmp: Path, name: str, solve: str, family: str = "create_file", seed: int = 0) -> Task:
    spec = generate(family, seed)
    spec = msgspec.structs.replace(spec, solution={"solve.sh": "#!/usr/bin/env bash\n" + solve + "\n"})
    return materialize(spec, tmp / name)


@pytest.fixture
async def sandbox(images, tmp_path):
    """(backend, proxy, socket path): a started Docker backend and a proxy listening on a Unix socket."""
    sock = tmp_path / "proxy.sock"
    backend = DockerBackend(DockerSettings(**OFFLINE), common=SandboxCommon(workdir=str(tmp_path / "work")))
    await backend.start()
    async with running_proxy(unix_socket=str(sock)) as (proxy, _records, _token):
        yield backend, proxy, str(sock)
    await backend.aclose()
    assert containers_of(backend.run_id) == []


async def test_oracle_one_untouched_zero_every_family(sandbox, tmp_path):
    backend, proxy, sock = sandbox
    results: dict[tuple[str, int, str], tuple[str, float, str]] = {}
    limiter = anyio.Semaphore(4)

    async def one(family: str, seed: int, kind: str) -> None:
        name = f"{family}-{seed}-{kind}"
        if kind == "oracle":
            task = materialize(generate(family, seed), tmp_path / name)
        else:
            task = variant(tmp_path, name, "exit 0", family=family, seed=seed)
        async with limiter:
            fin = await backend.run(request("oracle", task, rid=name), task, proxy_url=proxy.base_url,
                                    proxy_socket=sock)
        results[family, seed, kind] = (fin.status, fin.reward, fin.details)

    async with anyio.create_task_group() as tg:
        for family in family_names():
            for seed in SEEDS:
                for kind in ("oracle", "untouched"):
                    tg.start_soon(one, family, seed, kind)
    for (family, seed, kind), (status, reward, details) in sorted(results.items()):
        want = 1.0 if kind == "oracle" else 0.0
        assert (status, reward) == ("ok", want), f"{family} seed {seed} {kind}: {status} {reward}\n{details}"
    assert list((tmp_path / "work").iterdir()) == []


async def test_timeout(sandbox, tmp_path):
    backend, proxy, sock = sandbox
    task = variant(tmp_path, "sleepy", "echo started; sleep 300 & sleep 301")
    fin = await backend.run(request("oracle", task, timeout_s=2.0), task, proxy_url=proxy.base_url,
                            proxy_socket=sock)
    assert (fin.status, fin.reward) == ("timeout", 0.0), fin.details
    assert "killed after 2s" in fin.details and "started" not in fin.details  # the sandbox's text stays out
    assert containers_of(backend.run_id) == []


async def test_crash_is_harness_error(sandbox, tmp_path):
    backend, proxy, sock = sandbox
    task = variant(tmp_path, "crash", "echo boom >&2; exit 3")
    fin = await backend.run(request("oracle", task), task, proxy_url=proxy.base_url, proxy_socket=sock)
    assert (fin.status, fin.exit_code) == ("harness_error", 3), fin.details
    assert "harness exited with 3" in fin.details and "boom" not in fin.details
    assert containers_of(backend.run_id) == []


async def test_out_of_memory_is_harness_error(images, tmp_path):
    sock = tmp_path / "proxy.sock"
    backend = DockerBackend(DockerSettings(**OFFLINE, memory="64m"))
    await backend.start()
    task = variant(tmp_path, "hog", "python3 -c 'x = bytearray(512 << 20); print(len(x))'")
    async with running_proxy(unix_socket=str(sock)) as (proxy, _, _):
        fin = await backend.run(request("oracle", task), task, proxy_url=proxy.base_url, proxy_socket=str(sock))
    await backend.aclose()
    assert fin.status == "harness_error", fin.details
    assert containers_of(backend.run_id) == []


async def test_killed_from_outside_is_sandbox_error_and_limits_hold(sandbox, tmp_path):
    backend, proxy, sock = sandbox
    task = variant(tmp_path, "victim", "sleep 300")
    seen: dict = {}

    async def assassin():
        ids = await until(lambda: containers_of(backend.run_id, running_only=True), every_s=0.1)
        info = json.loads((await anyio.run_process(["docker", "inspect", ids[0]])).stdout)[0]
        seen.update(info["HostConfig"], labels=info["Config"]["Labels"])
        await anyio.run_process(["docker", "kill", ids[0]])

    fin = None

    async def victim():
        nonlocal fin
        fin = await backend.run(request("oracle", task), task, proxy_url=proxy.base_url, proxy_socket=sock)

    async with anyio.create_task_group() as tg:
        tg.start_soon(victim)
        tg.start_soon(assassin)
    assert fin is not None and fin.status == "sandbox_error", fin
    assert "killed from outside" in fin.details
    assert containers_of(backend.run_id) == []
    s = backend.settings
    assert seen["Privileged"] is False and seen["NetworkMode"] == "none"
    assert seen["Memory"] == 2 << 30 and seen["PidsLimit"] == s.pids and seen["NanoCpus"] == int(s.cpus * 1e9)
    assert seen["labels"][LABEL] == "1" and seen["labels"]["bridle.run"] == backend.run_id


async def test_cancellation_removes_the_container(sandbox, tmp_path):
    backend, proxy, sock = sandbox
    task = variant(tmp_path, "forever", "sleep 300")
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(backend.run, request("oracle", task), task, proxy_url=proxy.base_url,
                              proxy_socket=sock))
        await until(lambda: containers_of(backend.run_id), every_s=0.1)
        tg.cancel_scope.cancel()
    assert containers_of(backend.run_id) == []


async def test_start_reaps_leftovers(images):
    """A start removes a crashed run's containers (same host, owner process gone), and leaves a live run's alone:
    another run whose process is alive here, and a run of another host (its owner pid means nothing here)."""
    suffix = uuid.uuid4().hex[:8]

    async def leftover(run: str, owner: str, host: str = socket.gethostname()) -> str:
        proc = await anyio.run_process(
            ["docker", "create", "--label", f"{LABEL}=1", "--label", f"bridle.run={run}",
             "--label", f"bridle.host={host}", "--label", f"bridle.owner={owner}", "bridle-base", "sleep", "300"])
        return proc.stdout.decode().strip()

    crashed = await leftover(f"crashed-{suffix}", "2147483646")
    live = await leftover(f"live-{suffix}", str(os.getpid()))
    remote = await leftover(f"remote-{suffix}", "2147483646", host="another-host")
    try:
        backend = DockerBackend(DockerSettings(**OFFLINE))
        await backend.start()
        await backend.aclose()
        assert containers_of(f"crashed-{suffix}") == [], crashed
        assert [c[:12] for c in containers_of(f"live-{suffix}")] == [live[:12]]
        assert [c[:12] for c in containers_of(f"remote-{suffix}")] == [remote[:12]]
    finally:
        await anyio.run_process(["docker", "rm", "-f", crashed, live, remote], check=False)


class _Listener:
    """A TCP server on the host's 127.0.0.1 that records whether anyone connected."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop:
            try:
                c, _ = self.sock.accept()
                self.connections += 1
                c.close()
            except OSError:
                pass

    def close(self):
        self.stop = True
        self.thread.join()
        self.sock.close()


PROBE = r'''
import json, socket, urllib.request
def tcp(host, port):
    try:
        socket.create_connection((host, port), timeout=2).close()
        return "connected"
    except OSError as e:
        return type(e).__name__
res = {"host_loopback": tcp("127.0.0.1", {port}), "test_net": tcp("192.0.2.1", 80)}
try:
    res["proxy"] = urllib.request.urlopen("http://127.0.0.1:8080/health", timeout=5).status
except Exception as e:
    res["proxy"] = repr(e)
json.dump(res, open("/app/net.json", "w"))
'''


async def test_isolation_only_the_proxy_answers(images, tmp_path):
    listener = _Listener()
    sock = tmp_path / "proxy.sock"
    backend = DockerBackend(DockerSettings(**OFFLINE), common=SandboxCommon(workdir=str(tmp_path / "work"), keep_workspaces=True))
    await backend.start()
    probe = PROBE.replace("{port}", str(listener.port))
    task = variant(tmp_path, "probe", f"python3 - <<'EOF'\n{probe}\nEOF")
    try:
        async with running_proxy(unix_socket=str(sock)) as (proxy, _, _):
            fin = await backend.run(request("oracle", task), task, proxy_url=proxy.base_url,
                                    proxy_socket=str(sock))
    finally:
        await backend.aclose()
        listener.close()
    assert fin.status == "ok", fin.details
    (kept,) = (tmp_path / "work").iterdir()
    res = json.loads((kept / "app" / "net.json").read_text())
    assert res["proxy"] == 200, res
    assert res["host_loopback"] != "connected" and res["test_net"] != "connected", res
    assert listener.connections == 0


@pytest.mark.parametrize("network", ["none", "host"])
async def test_whitebox_in_docker_scores_one(images, tmp_path, network):
    task = materialize(generate("create_file", 5), tmp_path / "task")
    action = task.oracle_actions[0]
    script = Script(default=[ScriptResponse(tool_calls=[ScriptCall(name="write_file", arguments=action.args)]),
                             ScriptResponse(text="Done.")])
    sock = tmp_path / "proxy.sock"
    backend = DockerBackend(DockerSettings(**OFFLINE, network=network))
    await backend.start()
    async with running_proxy(script, unix_socket=str(sock)) as (proxy, records, _):
        req = request("whitebox:S2T0O2C0W0", task)
        proxy.register(req)
        fin = await backend.run(req, task, proxy_url=proxy.base_url, proxy_socket=str(sock))
    await backend.aclose()
    assert (fin.status, fin.reward) == ("ok", 1.0), fin.details
    assert sum(type(r).__name__ == "ModelCall" for r in records) == 2


@pytest.mark.harness
# read + write; read, edit, shell. OpenClaw (15 s a rollout here) runs the family that uses every tool kind; its
# text_processing run is the local backend's (tests/rollout/test_sandbox_local.py).
@pytest.mark.parametrize(("harness", "family"), [
    (h, f) for h in ("claude-code", "codex", "qwen-code", "openclaw") for f in ("text_processing", "bugfix")
    if (h, f) != ("openclaw", "text_processing")])
async def test_real_harness_in_its_image_scores_one(images, tmp_path, harness, family):
    """The task's oracle in the harness's own tools (the demonstration the scheduler scripts) scores 1 in the
    harness's image."""
    from pipeline.rollout.images import ImageError, build_all

    try:
        build_all((harness,))
    except ImageError as e:
        require(False, f"cannot build the {harness} image: {e}")
    task = materialize(generate(family, 2), tmp_path / "task")
    script = Script(default=msgspec.convert(oracle_script(task, harness), list[ScriptResponse]))
    sock = tmp_path / "proxy.sock"
    backend = DockerBackend(DockerSettings(**OFFLINE))
    await backend.start()
    # A Node harness's payload holds Node's compile cache, filled once; every rollout reads it and none can change it
    cache = (await backend.task_images.payload(HARNESSES[harness])) / COMPILE_CACHE
    before = cache_files(cache)
    async with running_proxy(script, unix_socket=str(sock)) as (proxy, records, _):
        req = request(harness, task, timeout_s=240)
        proxy.register(req)
        fin = await backend.run(req, task, proxy_url=proxy.base_url, proxy_socket=str(sock))
    await backend.aclose()
    assert (fin.status, fin.reward) == ("ok", 1.0), fin.details
    if HARNESSES[harness].needs_node:
        assert len(before) > 100 and cache_files(cache) == before
    else:
        assert not cache.exists()
    calls = [r for r in records if type(r).__name__ == "ModelCall"]
    assert len(calls) >= len(script.default)
    # the harness echoes every scripted call as it was sampled: the demonstration is history token for token
    assert [c.rendered_turns for c in calls] == [0] * len(calls)


async def test_missing_image_or_socket_is_sandbox_error(images, tmp_path):
    task = materialize(generate("create_file", 0), tmp_path / "task")
    backend = DockerBackend(DockerSettings(**OFFLINE, images={"oracle": "bridle-no-such-image"}))
    await backend.start()
    try:
        no_sock = await backend.run(request("oracle", task), task, proxy_url="http://127.0.0.1:9",
                                    proxy_socket=str(tmp_path / "absent.sock"))
        sock = tmp_path / "proxy.sock"
        async with running_proxy(unix_socket=str(sock)) as (proxy, _, _):
            no_image = await backend.run(request("oracle", task), task, proxy_url=proxy.base_url,
                                         proxy_socket=str(sock))
    finally:
        await backend.aclose()
    assert no_sock.status == "sandbox_error" and "unix_socket" in no_sock.details
    assert no_image.status == "sandbox_error" and "--build-images" in no_image.details, no_image.details
    assert containers_of(backend.run_id) == []
