"""The warm pool ([sandbox] warm) and the host-wide creation gate, on the local and Docker backends.

A pooled sandbox serves exactly one rollout; the next rollout's workspace, HOME (and, in Docker, /tmp) hold nothing
a hostile earlier rollout planted; a pooled sandbox that died is replaced, not handed out; the pool is drained on
stop, and a restart after ``kill -9`` leaves none of it behind. Docker cases skip without an engine, fail in CI.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from pipeline.core.runfiles import marked_pids
from pipeline.messages import ModelCall, RolloutRequest, ids
from pipeline.rollout.sandbox import DockerBackend, DockerSettings, LocalBackend, LocalSettings
from pipeline.rollout.sandbox.base import SandboxBackend, SandboxCommon
from pipeline.rollout.sandbox.local import MARKER_RUN
from pipeline.rollout.sandbox.warm import CreationGate
from pipeline.rollout.taskgen import generate
from pipeline.rollout.tasks import Task, materialize
from pipeline.serving.scripted import Script, ScriptCall, ScriptResponse
from pipeline.tokens.tokenizer import QwenTokenizer
from tests.helpers.docker import OFFLINE, containers_of, docker_available
from tests.helpers.poll import until
from tests.helpers.proxyutil import running_proxy

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[2]

PLANT = "echo planted > ~/planted; echo planted > planted.txt; echo planted > /tmp/planted; echo PLANTED"
CHECK = 'for f in ~/planted planted.txt {tmp}; do [ -e "$f" ] && echo "STALE $f"; done; echo CHECKED'


def shell(command: str) -> ScriptResponse:
    return ScriptResponse(tool_calls=[ScriptCall(name="bash", arguments={"command": command})])


def request(task: Task, rid: str) -> RolloutRequest:
    return RolloutRequest(rollout_id=rid, group_id=rid, index=0, group_size=1, task_id=task.id, harness="whitebox",
                          token=f"tok-{rid}", policy_version=0, timeout_s=60.0)


def make_backend(kind: str, tmp: Path, warm: int, run_id: str = "") -> SandboxBackend:
    common = SandboxCommon(workdir=str(tmp / "work"), warm=warm)
    if kind == "docker":
        return DockerBackend(DockerSettings(**OFFLINE), common, run_id=run_id)
    return LocalBackend(LocalSettings(), common, run_id=run_id)


def leftovers(kind: str, b: SandboxBackend) -> list[str]:
    """The run's containers (Docker) or marked processes (local: a sandbox may be several)."""
    if kind == "docker":
        return containers_of(b.run_id)
    return [str(p) for p in marked_pids(f"{MARKER_RUN}={b.run_id}".encode())]


def held(kind: str, b: SandboxBackend) -> int:
    """How many sandboxes the backend holds: the pooled ones, between rollouts."""
    return len(containers_of(b.run_id)) if kind == "docker" else len(b._live)  # type: ignore[attr-defined]


@pytest.fixture(params=["local", "docker"])
def kind(request, tmp_path):
    if request.param == "docker":
        if not docker_available():
            from tests.helpers.ci import require

            require(False, "no Docker engine (start dockerd; harness_images/ci_setup.sh does it)")
        request.getfixturevalue("images")
    return request.param


def prompt_texts(records, rid: str) -> list[str]:
    tok = QwenTokenizer()
    calls = sorted((r for r in records if isinstance(r, ModelCall) and r.rollout_id == rid), key=lambda c: c.seq)
    return [tok.decode(ids(c.input_ids)) for c in calls]


async def test_each_pooled_sandbox_serves_one_rollout_and_starts_fresh(kind, tmp_path):
    task = materialize(generate("create_file", 3), tmp_path / "task")
    # Docker gives each sandbox its own /tmp; the local backend shares the host's (no boundary, by design)
    tmp_check = "/tmp/planted" if kind == "docker" else ""
    n = 5
    script = Script(rollouts={"r0": [shell(PLANT), ScriptResponse(text="Done.")],
                              **{f"r{i}": [shell(CHECK.format(tmp=tmp_check)), ScriptResponse(text="Done.")]
                                 for i in range(1, n)}})
    b = make_backend(kind, tmp_path, warm=2)
    await b.start()
    assert b.pool is not None
    handed: list[object] = []
    take = b.pool.take

    async def recording_take(key, template):
        entry = await take(key, template)
        if entry is not None:
            handed.append(entry)
        return entry

    b.pool.take = recording_take  # type: ignore[method-assign]
    try:
        async with (running_proxy(script, unix_socket=str(tmp_path / "proxy.sock")) as (proxy, records, _),
                    anyio.create_task_group() as tg):
            tg.start_soon(b.keep_warm)
            for i in range(n):
                req = request(task, f"r{i}")
                proxy.register(req)
                fin = await b.run(req, task, proxy_url=proxy.base_url, proxy_socket=proxy.unix_socket)
                assert fin.status == "ok", fin.details
                await until(lambda: b.pool.ready == 2, timeout_s=60)
            tg.cancel_scope.cancel()
        for i in range(1, n):
            seen = prompt_texts(records, f"r{i}")[-1].rsplit("<tool_response>", 1)[1]  # what the check printed
            assert "CHECKED" in seen and "STALE" not in seen, seen
        assert "PLANTED" in prompt_texts(records, "r0")[-1].rsplit("<tool_response>", 1)[1]
        assert b.pool.counts["hits"] == n - 1 and b.pool.counts["misses"] == 1  # the first one finds none ready
        assert len(handed) == n - 1 and len({id(e) for e in handed}) == n - 1
        # nothing handed out stays behind: each taken sandbox went with its rollout
        assert held(kind, b) == 2
    finally:
        await b.aclose()
    assert leftovers(kind, b) == []  # drained on stop
    assert list((tmp_path / "work").iterdir()) == []


async def test_a_dead_pooled_sandbox_is_replaced_not_handed_out(kind, tmp_path):
    task = materialize(generate("create_file", 3), tmp_path / "task")
    action = task.oracle_actions[0]
    solve = [ScriptResponse(tool_calls=[ScriptCall(name="write_file", arguments=action.args)]),
             ScriptResponse(text="Done.")]
    b = make_backend(kind, tmp_path, warm=1)
    await b.start()
    assert b.pool is not None
    try:
        async with (running_proxy(Script(default=solve), unix_socket=str(tmp_path / "proxy.sock")) as (proxy, _, _),
                    anyio.create_task_group() as tg):
            tg.start_soon(b.keep_warm)
            first = request(task, "first")
            proxy.register(first)
            fin = await b.run(first, task, proxy_url=proxy.base_url, proxy_socket=proxy.unix_socket)
            assert (fin.status, fin.reward) == ("ok", 1.0), fin.details
            await until(lambda: b.pool.ready == 1, timeout_s=60)
            (entry,) = next(iter(b.pool._keys.values())).ready
            if kind == "docker":
                await anyio.run_process(["docker", "kill", entry.container.id])
                await until(lambda: not containers_of(b.run_id, running_only=True))
            else:
                os.killpg(entry.proc.pid, signal.SIGKILL)
                await entry.proc.wait()
            second = request(task, "second")
            proxy.register(second)
            fin = await b.run(second, task, proxy_url=proxy.base_url, proxy_socket=proxy.unix_socket)
            tg.cancel_scope.cancel()
        assert (fin.status, fin.reward) == ("ok", 1.0), fin.details
        assert b.pool.counts["dead"] == 1 and b.pool.counts["hits"] == 0
    finally:
        await b.aclose()
    assert leftovers(kind, b) == []


RESTART = textwrap.dedent("""
    import sys, anyio
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from tests.rollout.test_warm_pool import make_backend, warm_key
    kind, tmp, run_id = sys.argv[1], Path(sys.argv[2]), sys.argv[3]

    async def main():
        b = make_backend(kind, tmp, warm=2, run_id=run_id)
        await b.start()
        key, template = await warm_key(kind, b, tmp)
        await b.pool.take(key, template)
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.keep_warm)
            while b.pool.ready < 2:
                await anyio.sleep(0.05)
            print("READY", flush=True)
            await anyio.sleep(600)
    anyio.run(main)
""")


async def warm_key(kind: str, b: SandboxBackend, tmp: Path) -> tuple[object, object]:
    """A key and template as the first rollout of a whitebox task would give them."""
    if kind == "local":
        return "local", None
    from pipeline.rollout.harnesses import HARNESSES
    from pipeline.rollout.sandbox.container import task_limits
    from pipeline.rollout.sandbox.docker import _WarmTemplate

    assert isinstance(b, DockerBackend)
    task = materialize(generate("create_file", 3), tmp / "task")
    sock = tmp / "fake.sock"
    sock.touch()
    image = await b.task_images.resolve(task)
    payload = await b.task_images.payload(HARNESSES["whitebox"])
    limits = task_limits(task, cpus=1.0, memory=b.memory_bytes, pids=64)
    return ("restart", image.ref), _WarmTemplate(image, HARNESSES["whitebox"], payload, str(sock), limits,
                                                 b.storage_bytes)


async def test_a_restart_after_kill_9_leaves_no_pooled_sandbox(kind, tmp_path):
    run_id = f"warmkill{os.getpid()}"
    script = tmp_path / "restart.py"
    script.write_text(RESTART.format(root=str(ROOT)))
    proc = subprocess.Popen([sys.executable, str(script), kind, str(tmp_path), run_id],  # noqa: ASYNC220 - killed -9
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        line = await anyio.to_thread.run_sync(proc.stdout.readline)
        assert line.strip() == "READY"
        b = make_backend(kind, tmp_path, warm=2, run_id=run_id)
        assert leftovers(kind, b)  # the two pooled (the first take only made the key known)
        if kind == "docker":
            assert len(leftovers(kind, b)) == 2
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    await b.start()  # the restart of the run: reaps what the killed process left
    try:
        with anyio.fail_after(30):
            await until(lambda: leftovers(kind, b) == [])
        assert not [p for p in (tmp_path / "work").iterdir() if p.name.startswith("bridle-")]
    finally:
        await b.aclose()


async def test_creation_gate_bounds_rate_and_concurrency_across_gates(tmp_path):
    # Two gates on one folder stand for two bridle processes on one host.
    a = CreationGate(per_s=20.0, at_once=1, folder=tmp_path)
    b = CreationGate(per_s=20.0, at_once=1, folder=tmp_path)
    inside, most, starts, turns = 0, 0, [], []

    async def create(gate: CreationGate) -> None:
        nonlocal inside, most
        async with gate.slot():
            starts.append(time.time())
            turns.append(float((tmp_path / "turns").read_text()))  # one holder at a time: this creation's turn
            inside += 1
            most = max(most, inside)
            await anyio.sleep(0.01)
            inside -= 1

    async with anyio.create_task_group() as tg:
        for i in range(10):
            tg.start_soon(create, a if i % 2 else b)
    assert most == 1
    # never faster than 20 a second, whichever gate asked: the booked turns lie 1/20 s apart and none starts early
    # (the observed start times also carry the event loop's wake-up jitter, so they are not compared with each other)
    gaps = [y - x for x, y in itertools.pairwise(turns)]
    assert min(gaps) >= 1 / 20.0 - 1e-5, gaps
    assert all(start >= turn - 0.005 for start, turn in zip(starts, turns, strict=True))
    assert a.created + b.created == 10 and a.waited_s + b.waited_s > 0.3
