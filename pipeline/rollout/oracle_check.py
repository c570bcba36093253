"""Harbor's oracle check: every task's solution/solve.sh, run in place of an agent, must score 1.

    python -m pipeline.rollout.oracle_check TASKS [--backend docker|local] [--concurrency N]
        [--verifier-network bridge|none] [--build-network bridge|none] [--cpus C] [--memory M]

``TASKS`` is a task folder or a folder of them; every folder is validated first (all problems at once). Then each
task with a ``solution/solve.sh`` gets one oracle rollout through the sandbox backend, as a training run would run
it: under Docker in the task's own image (its ``environment/Dockerfile`` built offline, or found in the cache),
with the task's limits and timeouts, the verifier in a fresh container from that image. A table gives each task's
status, reward and time; the exit status is 0 when every task scored at least 1, 1 otherwise, 2 for invalid
folders. Tasks without ``solve.sh`` are listed and not counted.
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import time
from pathlib import Path

import anyio

from pipeline.core.logs import configure
from pipeline.messages import RolloutFinished, RolloutRequest
from pipeline.rollout.sandbox import DockerBackend, DockerSettings, LocalBackend, SandboxBackend
from pipeline.rollout.tasks import Task, TaskError, load_task_dir

TIMEOUT_S = 3600.0  # the request's limit; the task's [agent] timeout_sec bounds the oracle when it gives one


async def check(tasks: list[Task], backend: SandboxBackend, concurrency: int) -> dict[str, tuple[RolloutFinished, float]]:
    """One oracle rollout per task that has a solve.sh: task id -> (its result, seconds)."""
    results: dict[str, tuple[RolloutFinished, float]] = {}
    limiter = anyio.Semaphore(concurrency)
    with tempfile.TemporaryDirectory(prefix="bridle-oracle-") as tmp:
        # The Docker sandbox reaches its policy through a Unix socket; the oracle asks none, so nothing answers.
        sock_path = str(Path(tmp) / "proxy.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.bind(sock_path)
            sock.listen(1)
            await backend.start()
            try:
                async def one(i: int, task: Task) -> None:
                    req = RolloutRequest(rollout_id=f"oracle-{i}", group_id=f"oracle-{i}", index=0, group_size=1,
                                         task_id=task.id, harness="oracle", token="oracle", policy_version=0,
                                         timeout_s=TIMEOUT_S, task_path=task.path)
                    async with limiter:
                        t0 = time.monotonic()
                        fin = await backend.run(req, task, proxy_url="http://127.0.0.1:9", proxy_socket=sock_path)
                        results[task.id] = (fin, time.monotonic() - t0)

                async with anyio.create_task_group() as tg:
                    for i, task in enumerate(tasks):
                        if task.solve_sh is not None:
                            tg.start_soon(one, i, task)
            finally:
                await backend.aclose()
    return results


def report(tasks: list[Task], results: dict[str, tuple[RolloutFinished, float]]) -> tuple[str, bool]:
    """(the table, whether every task with a solve.sh scored at least 1)."""
    width = max([len(t.id) for t in tasks] + [4])
    lines = [f"{'task':<{width}}  {'status':<15}{'reward':>7}{'seconds':>9}  details"]
    ok = True
    for t in tasks:
        if t.id not in results:
            lines.append(f"{t.id:<{width}}  {'no solve.sh':<15}{'':>7}{'':>9}")
            continue
        fin, secs = results[t.id]
        passed = fin.status == "ok" and fin.reward >= 1.0
        ok &= passed
        first = (fin.details.splitlines() or [""])[0][:100]
        lines.append(f"{t.id:<{width}}  {fin.status:<15}{fin.reward:>7g}{secs:>9.1f}  {first}")
    scored = [r for r, _ in results.values()]
    lines.append(f"{sum(r.status == 'ok' and r.reward >= 1 for r in scored)} of {len(scored)} oracle solutions "
                 "scored 1")
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.rollout.oracle_check", description=__doc__.split("\n\n")[0])
    p.add_argument("tasks", help="a task folder or a folder of task folders")
    p.add_argument("--backend", choices=("docker", "local"), default="docker")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--verifier-network", choices=("bridge", "none"), default="bridge")
    p.add_argument("--build-network", choices=("bridge", "none"), default="bridge")
    p.add_argument("--cpus", type=float, default=DockerSettings().cpus, help="the most a task may ask")
    p.add_argument("--memory", default=DockerSettings().memory, help="the most a task may ask")
    p.add_argument("--log-level", default="warning", help="bridle's log lines on stderr (default: warnings)")
    args = p.parse_args(argv)
    configure(level=args.log_level)
    try:
        tasks = load_task_dir(args.tasks)
    except TaskError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    backend: SandboxBackend
    if args.backend == "local":
        backend = LocalBackend()
    else:
        backend = DockerBackend(DockerSettings(verifier_network=args.verifier_network, cpus=args.cpus,
                                               memory=args.memory, build_network=args.build_network))
    try:
        results = anyio.run(check, tasks, backend, max(1, args.concurrency))
    except RuntimeError as e:  # no Docker engine
        print(f"error: {e}", file=sys.stderr)
        return 2
    table, ok = report(tasks, results)
    print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
