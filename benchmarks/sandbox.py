#!/usr/bin/env python3
"""Sandbox backends: start-to-ready latency and how many idle sandboxes this machine sustains.

    python benchmarks/sandbox.py [--backends local,docker] [--samples 20] [--concurrent 64]
    python benchmarks/sandbox.py --ray-address HOST:PORT [--starts 64] [--starts-concurrency 8]

start-to-ready: RolloutTimings.sandbox_ready - queued for a rollout whose harness exits at once (workspace laid
out, process / container started; Docker: container created, files copied in, started). Also the whole rollout
(harness + verifier + teardown). Idle sandboxes: ``--concurrent`` rollouts whose harness sleeps, started together;
the table shows how many were running at once and their memory: the PSS of every process of a sandbox
(Docker: including the container's containerd shim), averaged over the sandboxes. Goal: 64 on 2 cores / 24 GB.
Docker needs the images (``python -m pipeline.rollout.images``).

With ``--ray-address`` (a running cluster whose nodes declare ``bridle_docker``), a second table puts the Ray
backend beside the local Docker backend: ``--starts`` quick rollouts, ``--starts-concurrency`` at a time; sandboxes
started per second (rollouts / wall time) and the p50 start latency (from submission here to the harness's container
started, on whichever node).

    python benchmarks/sandbox.py --handouts 16 [--handout-concurrency 4] [--backends local,docker]

Hand-outs with the warm pool against cold starts, in one run per backend: ``--handouts`` white-box rollouts (the
scripted engine answers at once), ``--handout-concurrency`` at a time, cold (``[sandbox] warm = 0``) and from a
pool of as many sandboxes, filled beforehand: sandboxes handed out per second (rollouts / time from the first
queued to the last harness started) and the p50 / p95 of queued -> harness started.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import msgspec
import numpy as np

from pipeline.messages import RolloutRequest
from pipeline.rollout.sandbox import DockerBackend, DockerSettings, LocalBackend, LocalSettings
from pipeline.rollout.sandbox.base import SandboxCommon
from pipeline.rollout.sandbox.local import MARKER_ID, MARKER_RUN
from pipeline.rollout.sandbox.ray_backend import RayBackend, RaySettings
from pipeline.rollout.taskgen import generate
from pipeline.rollout.tasks import Task, materialize
from pipeline.serving.proxy import Proxy, ProxySettings
from pipeline.serving.scripted import Script, ScriptedEngine
from pipeline.tokens.render import qwen3_renderer


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def pss(pid: int) -> int:
    for line in _read(f"/proc/{pid}/smaps_rollup").decode().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def sandboxes(backend) -> dict[str, list[int]]:
    """Sandbox id -> its processes (Docker: plus the container's containerd shim). Sandboxes, not processes, are
    counted, and memory is the processes' PSS, so shared pages (the image's libraries) are split fairly."""
    groups: dict[str, list[int]] = {}
    pids = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    if isinstance(backend, LocalBackend):
        run = f"{MARKER_RUN}={backend.run_id}".encode()
        for pid in pids:
            env = _read(f"/proc/{pid}/environ").split(b"\0")
            if run in env:
                sid = next((v for v in env if v.startswith(MARKER_ID.encode() + b"=")), b"?")
                groups.setdefault(sid.decode(), []).append(pid)
        return groups
    out = subprocess.run(["docker", "ps", "-q", "--no-trunc", "--filter", f"label=bridle.run={backend.run_id}",
                          "--filter", "label=bridle.role=harness"], capture_output=True, text=True, check=False)
    ids = set(out.stdout.split())
    for pid in pids:
        text = _read(f"/proc/{pid}/cgroup").decode() + _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode()
        for cid in ids:
            if cid in text:
                groups.setdefault(cid, []).append(pid)
                break
    for cid in ids:
        groups.setdefault(cid, [])
    return groups


def task_with(tmp: Path, name: str, solve: str) -> Task:
    spec = generate("create_file", 0)
    spec = msgspec.structs.replace(spec, solution={"solve.sh": "#!/usr/bin/env bash\n" + solve + "\n"})
    return materialize(spec, tmp / name)


def req(i: int, task: Task, timeout_s: float) -> RolloutRequest:
    return RolloutRequest(rollout_id=f"bench-{i}", group_id="bench", index=i, group_size=1, task_id=task.id,
                          harness="oracle", token="t", policy_version=0, timeout_s=timeout_s)


@contextlib.asynccontextmanager
async def scripted_proxy(sock: Path) -> AsyncIterator[Proxy]:
    """A proxy over the scripted engine, also on ``sock``: every sandbox is given one to reach (the oracle harness
    runs the task's solve.sh and never calls the model)."""
    renderer = qwen3_renderer()

    async def drop(_record: object) -> None:
        pass

    proxy = Proxy(ScriptedEngine(renderer, Script()), renderer, drop, ProxySettings(unix_socket=str(sock)))
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()


async def bench(kind: str, samples: int, concurrent: int, tmp: Path) -> dict:
    sock = tmp / f"{kind}.sock"
    backend = LocalBackend() if kind == "local" else DockerBackend(DockerSettings(cpus=0.5, memory="256m"))
    await backend.start()
    quick = task_with(tmp, f"{kind}-quick", "exit 0")
    idle = task_with(tmp, f"{kind}-idle", "sleep 600")
    row: dict = {"backend": kind}
    async with scripted_proxy(sock) as proxy:
        ready, total = [], []
        for i in range(samples):
            t0 = time.time()
            fin = await backend.run(req(i, quick, 60), quick, proxy_url=proxy.base_url, proxy_socket=str(sock))
            if fin.status != "ok":
                raise RuntimeError(f"{kind}: warm-up rollout failed: {fin.status} {fin.details}")
            ready.append(fin.timings.sandbox_ready - fin.timings.queued)
            total.append(time.time() - t0)
        row.update(ready_p50=np.percentile(ready, 50), ready_p95=np.percentile(ready, 95),
                   rollout_p50=np.percentile(total, 50))

        t0 = time.time()
        async with anyio.create_task_group() as tg:
            for i in range(concurrent):
                tg.start_soon(lambda i=i: backend.run(req(1000 + i, idle, 900), idle, proxy_url=proxy.base_url,
                                                      proxy_socket=str(sock)))
            deadline = time.time() + 600
            while time.time() < deadline:
                await anyio.sleep(1.0)
                n = len(await anyio.to_thread.run_sync(sandboxes, backend))
                if n >= concurrent:
                    break
            row["all_up_s"] = time.time() - t0
            await anyio.sleep(3.0)  # let start-up transients settle before measuring
            groups = await anyio.to_thread.run_sync(sandboxes, backend)
            used = sum(pss(pid) for procs in groups.values() for pid in procs)
            row["running"] = len(groups)
            tg.cancel_scope.cancel()
    await backend.aclose()
    row.update(concurrent=row["running"], mem_per_sandbox_mb=used / max(row["running"], 1) / 2**20,
               left_over=len(await anyio.to_thread.run_sync(sandboxes, backend)))
    return row


async def starts(kind: str, n: int, concurrency: int, ray_address: str, tmp: Path) -> dict:
    """Docker vs Ray, side by side: ``n`` quick rollouts, ``concurrency`` at a time."""
    sock = tmp / f"starts-{kind}.sock"
    docker = DockerSettings(cpus=0.5, memory="256m")
    backend = (RayBackend(RaySettings(address=ray_address), docker, run_id="bench-ray") if kind == "ray"
               else DockerBackend(docker))
    await backend.start()
    quick = task_with(tmp, f"starts-{kind}", "exit 0")
    latency: list[float] = []
    limiter = anyio.CapacityLimiter(concurrency)
    async with scripted_proxy(sock) as proxy:

        async def one(i: int) -> None:
            async with limiter:
                t0 = time.time()
                fin = await backend.run(req(5000 + i, quick, 60), quick, proxy_url=proxy.base_url,
                                        proxy_socket=str(sock))
                if fin.status != "ok":
                    raise RuntimeError(f"{kind}: rollout failed: {fin.status} {fin.details}")
                latency.append(fin.timings.sandbox_ready - t0)

        await one(-1)  # warm-up: images resolved, relays and Ray workers started
        latency.clear()
        t0 = time.time()
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
        wall = time.time() - t0
    await backend.aclose()
    return {"backend": kind, "per_s": n / wall, "p50": float(np.percentile(latency, 50)),
            "p95": float(np.percentile(latency, 95))}


async def handouts(kind: str, n: int, concurrency: int, tmp: Path) -> list[list[str]]:
    """Cold vs a full warm pool of ``n``: hand-outs per second and start latency (see the module docstring)."""
    task = materialize(generate("create_file", 0), tmp / f"handout-{kind}")
    return [await handout_row(kind, warm, n, concurrency, task, tmp) for warm in (0, n)]


async def handout_row(kind: str, warm: int, n: int, concurrency: int, task: Task, tmp: Path) -> list[str]:
    common = SandboxCommon(warm=warm, workdir=str(tmp / "work"))
    backend = (LocalBackend(LocalSettings(), common) if kind == "local"
               else DockerBackend(DockerSettings(cpus=0.5, memory="256m"), common))
    await backend.start()
    sock = tmp / f"handout-{kind}-{warm}.sock"
    ready: list[tuple[float, float]] = []
    limiter = anyio.CapacityLimiter(concurrency)
    async with scripted_proxy(sock) as proxy, anyio.create_task_group() as tg:
        tg.start_soon(backend.keep_warm)

        async def one(i: int) -> None:
            r = RolloutRequest(rollout_id=f"h{warm}-{i}", group_id="h", index=i, group_size=1, task_id=task.id,
                               harness="whitebox", token=f"t{i}", policy_version=0, timeout_s=120)
            proxy.register(r)
            async with limiter:
                fin = await backend.run(r, task, proxy_url=proxy.base_url, proxy_socket=str(sock))
            if fin.status != "ok":
                raise RuntimeError(f"{kind}: rollout failed: {fin.status} {fin.details}")
            ready.append((fin.timings.queued, fin.timings.sandbox_ready))

        await one(-1)  # the pool learns the kind; images, payload and page cache warm for both
        ready.clear()
        if warm:
            assert backend.pool is not None
            with anyio.fail_after(600):
                while backend.pool.ready < warm:  # noqa: ASYNC110 - no event says so
                    await anyio.sleep(0.05)
        async with anyio.create_task_group() as inner:
            for i in range(n):
                inner.start_soon(one, i)
        tg.cancel_scope.cancel()
    await backend.aclose()
    lat = [b - a for a, b in ready]
    span = max(b for _, b in ready) - min(a for a, _ in ready)
    return [kind, "warm" if warm else "cold", f"{n / span:.2f}", f"{np.percentile(lat, 50) * 1e3:.0f}",
            f"{np.percentile(lat, 95) * 1e3:.0f}"]


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="local,docker")
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--concurrent", type=int, default=64)
    p.add_argument("--ray-address", default="", help="a Ray cluster: also compare the ray backend with docker")
    p.add_argument("--starts", type=int, default=64)
    p.add_argument("--starts-concurrency", type=int, default=8)
    p.add_argument("--handouts", type=int, default=0, help="hand-outs from a warm pool vs cold starts (this many)")
    p.add_argument("--handout-concurrency", type=int, default=4)
    args = p.parse_args()
    if args.handouts:
        with tempfile.TemporaryDirectory(prefix="bridle-bench-") as tmp:
            rows = [r for kind in args.backends.split(",")
                    for r in await handouts(kind, args.handouts, args.handout_concurrency, Path(tmp))]
        print(f"\n{args.handouts} white-box rollouts, {args.handout_concurrency} at a time; {os.cpu_count()} cores")
        print("backend | sandboxes | handed out / s | queued -> started p50 ms | p95 ms\n--- | --- | --- | --- | ---")
        for r in rows:
            print(" | ".join(r))
        return
    if args.ray_address:
        with tempfile.TemporaryDirectory(prefix="bridle-bench-") as tmp:
            side = [await starts(kind, args.starts, args.starts_concurrency, args.ray_address, Path(tmp))
                    for kind in ("docker", "ray")]
        print(f"\n{args.starts} quick rollouts, {args.starts_concurrency} at a time")
        print("backend | sandboxes started/s | start p50 ms | start p95 ms\n--- | --- | --- | ---")
        for r in side:
            print(f"{r['backend']} | {r['per_s']:.2f} | {r['p50'] * 1e3:.0f} | {r['p95'] * 1e3:.0f}")
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="bridle-bench-") as tmp:
        for kind in args.backends.split(","):
            if kind == "docker" and (shutil.which("docker") is None or (await anyio.run_process(
                    ["docker", "info"], check=False)).returncode != 0):
                print("docker: no engine, skipped")
                continue
            rows.append(await bench(kind, args.samples, args.concurrent, Path(tmp)))
    print(f"\nmachine: {os.cpu_count()} cores, {mem_available() / 2**30:.1f} GiB available now")
    hdr = ("backend", "ready p50 ms", "ready p95 ms", "rollout p50 ms", "idle running", "all up s", "MB/sandbox",
           "left over")
    print(" | ".join(hdr))
    print(" | ".join("---" for _ in hdr))
    for r in rows:
        print(" | ".join([r["backend"], f"{r['ready_p50'] * 1e3:.0f}", f"{r['ready_p95'] * 1e3:.0f}",
                          f"{r['rollout_p50'] * 1e3:.0f}", f"{r['concurrent']}/{args.concurrent}",
                          f"{r['all_up_s']:.1f}", f"{r['mem_per_sandbox_mb']:.1f}", str(r["left_over"])]))


if __name__ == "__main__":
    anyio.run(main)
