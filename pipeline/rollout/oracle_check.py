"""Harbor's oracle check: every task's solution/solve.sh, run in place of an agent, must score 1.

    python -m pipeline.rollout.oracle_check TASKS [--backend docker|local] [--concurrency N]
        [--verifier-network bridge|none] [--build-network bridge|none] [--cpus C] [--memory M]
        [--base-image IMAGE=LOCAL_IMAGE ...] [--show-output]

``TASKS`` is a task folder or a folder of them; every folder is validated first (all problems at once). Then each
task with a ``solution/solve.sh`` gets one oracle rollout through the sandbox backend, as a training run would run
it: under Docker in the task's own image (its ``environment/Dockerfile`` built offline, or found in the cache),
with the task's limits and timeouts, the verifier in a fresh container from that image. A table gives each task's
status, reward and time, then the full verdict of each task that did not score 1; a verifier whose test.sh shows a
failed network lookup while it had no network is named as such ("offline?"): a silent 0 is then the missing
network, not a wrong solution. ``--show-output`` adds the start of each such task's test.sh output.
``--base-image`` maps an image a task's Dockerfile builds on (``FROM ubuntu:24.04``) to one on this machine, as
``[sandbox.docker] base_images`` does in a run. The exit status is 0 when every task scored at least 1, 1
otherwise, 2 for invalid folders or arguments. Tasks without ``solve.sh`` are listed and not counted.
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
from pipeline.rollout.sandbox import (
    DockerBackend,
    DockerSettings,
    LocalBackend,
    LocalSettings,
    SandboxBackend,
    SandboxCommon,
)
from pipeline.rollout.tasks import Task, TaskError, load_task_dir
from pipeline.rollout.untrusted import UntrustedFileError, printable, read_under

TIMEOUT_S = 3600.0  # the request's limit; the task's [agent] timeout_sec bounds the oracle when it gives one
OUTPUT_CHARS = 4000  # of test.sh's output per task with --show-output
OFFLINE_NOTE = "failed network lookup"  # in the Docker verifier's note (docker_verify.verify_in_container)


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


def offline(fin: RolloutFinished) -> bool:
    """The verifier had no network and test.sh's output shows a failed lookup: its verdict may be the network's."""
    return OFFLINE_NOTE in fin.details


def report(tasks: list[Task], results: dict[str, tuple[RolloutFinished, float]],
           outputs: dict[str, str] | None = None) -> tuple[str, bool]:
    """(the table and each failing task's full verdict, whether every task with a solve.sh scored at least 1)."""
    width = max([len(t.id) for t in tasks] + [4])
    lines = [f"{'task':<{width}}  {'status':<17}{'reward':>7}{'seconds':>9}  verdict"]
    failing: list[str] = []
    for t in tasks:
        if t.id not in results:
            lines.append(f"{t.id:<{width}}  {'no solve.sh':<17}{'':>7}{'':>9}")
            continue
        fin, secs = results[t.id]
        status = fin.status + (" offline?" if offline(fin) else "")
        if not (fin.status == "ok" and fin.reward >= 1.0):
            failing.append(t.id)
        first = (fin.details.splitlines() or [""])[0]
        first = first if len(first) <= 100 else first[:99] + "…"
        lines.append(f"{t.id:<{width}}  {status:<17}{fin.reward:>7g}{secs:>9.1f}  {first}")
    scored = [r for r, _ in results.values()]
    lines.append(f"{sum(r.status == 'ok' and r.reward >= 1 for r in scored)} of {len(scored)} oracle solutions "
                 "scored 1" + (f"; {n} verifier(s) failed offline (rerun with --verifier-network bridge)"
                               if (n := sum(map(offline, scored))) else ""))
    for tid in failing:
        fin = results[tid][0]
        lines += ["", f"== {tid}: {fin.status}, reward {fin.reward:g}", fin.details or "(no verdict given)"]
        if outputs is not None:
            lines += ["-- test.sh output (start):", outputs.get(tid) or "(none kept)"]
    return "\n".join(lines), not failing


def test_outputs(workdir: Path, ids: dict[str, str]) -> dict[str, str]:
    """task id -> the start of its test.sh output, from the rollout folders kept under ``workdir`` (rollout id
    per task in ``ids``). The file is the task's: read without following links, control characters removed."""
    out: dict[str, str] = {}
    for tid, rid in ids.items():
        for root in sorted(workdir.glob(f"bridle-*_{rid}-*")):
            try:
                data = read_under(root / "logs", "verifier/test-stdout.txt", OUTPUT_CHARS, head=True)
            except (OSError, UntrustedFileError):
                continue
            out[tid] = printable(data.decode("utf-8", "replace")).rstrip()
    return out


def base_image_map(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        image, sep, local = pair.partition("=")
        if not sep or not image or not local:
            raise ValueError(f"--base-image {pair}: give IMAGE=LOCAL_IMAGE, e.g. ubuntu:24.04=bridle-rootfs:bookworm")
        out[image] = local
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.rollout.oracle_check", description=__doc__.split("\n\n")[0])
    p.add_argument("tasks", help="a task folder or a folder of task folders")
    p.add_argument("--backend", choices=("docker", "local"), default="docker")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--verifier-network", choices=("bridge", "none"), default="bridge")
    p.add_argument("--build-network", choices=("bridge", "none"), default="bridge")
    p.add_argument("--cpus", type=float, default=DockerSettings().cpus, help="the most a task may ask")
    p.add_argument("--memory", default=DockerSettings().memory, help="the most a task may ask")
    p.add_argument("--base-image", action="append", default=[], metavar="IMAGE=LOCAL_IMAGE",
                   help="build a task's FROM IMAGE on LOCAL_IMAGE instead (repeatable)")
    p.add_argument("--show-output", action="store_true", help="print the start of test.sh's output of each task "
                   "that did not score 1")
    p.add_argument("--log-level", default="warning", help="bridle's log lines on stderr (default: warnings)")
    args = p.parse_args(argv)
    configure(level=args.log_level)
    try:
        tasks = load_task_dir(args.tasks)
        bases = base_image_map(args.base_image)
    except (TaskError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bridle-oracle-work-", ignore_cleanup_errors=True) as work:
        common = SandboxCommon(keep_workspaces=args.show_output, workdir=work)
        backend: SandboxBackend
        if args.backend == "local":
            backend = LocalBackend(LocalSettings(), common)
        else:
            docker = DockerSettings(verifier_network=args.verifier_network, cpus=args.cpus, memory=args.memory,
                                    build_network=args.build_network, base_images=bases)
            if why := docker.problem("oracle_check") or docker.machine_problem("oracle_check"):
                print(f"error: {why.replace('oracle_check cpus', '--cpus').replace('oracle_check memory', '--memory')}",
                      file=sys.stderr)
                return 2
            backend = DockerBackend(docker, common)
        try:
            results = anyio.run(check, tasks, backend, max(1, args.concurrency))
        except RuntimeError as e:  # no Docker engine
            print(f"error: {e}", file=sys.stderr)
            return 2
        outputs = None
        if args.show_output:
            ids = {t.id: f"oracle-{i}" for i, t in enumerate(tasks) if t.id in results}
            outputs = test_outputs(Path(work), ids)
        table, ok = report(tasks, results, outputs)
    print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
