#!/usr/bin/env python3
"""Fault campaign (issue 34): the quickstart with faults injected at random moments, seeded and repeated, and after
each run the invariant checker over its folder (pipeline/cli/invariants.py: every started call ended, every rollout
settled or counted as failed, every step trained once, every row present, no leftovers).

    python benchmarks/faults.py [--faults 50] [--seed 0] [--kinds runpy,engine,proxy_worker,sandbox,ray_node]
                                [--per-run 4] [--out DIR] [--policy DIR] [--json FILE]

Fault kinds, each SIGKILL, its target found among the descendants of the run.py this script started:

- ``runpy``: run.py itself, at a random moment of its attempt; then ``run.py --resume``.
- ``engine``: the embedded engine's process; the run must fail at once (exit 1, the proxy stopped with EngineDied
  and code -9); then ``--resume``.
- ``proxy_worker``: one of the proxy worker processes (``--set proxy.workers=2``: the quickstart's default, 1,
  serves in run.py's own process); the run must fail at once (exit 1, WorkerDied naming it); then ``--resume``.
- ``sandbox``: every process of one live sandbox (a harness of a rollout, local backend); that rollout must end
  failed and the run go on.
- ``ray_node``: the worker node of a two-node Ray cluster on this machine (its whole process group: raylet, workers,
  the relay) while a sandbox of it runs (``sandbox.backend = "ray"``, Docker sandboxes); its rollouts end as
  sandbox_error and the run goes on; a new worker node joins before the next fault. Needs Ray and Docker with the
  sandbox images; otherwise the row says n/a and why.

Several faults go into one run in sequence (``--per-run``): fault, resume, fault again at a random later moment, and
so on; then the run finishes and is checked. A fault survived when its own expectation held (above), its run
finished with exit code 0 and every invariant held; otherwise it is lost, with what broke (a broken invariant is
charged to every fault of its run). The runs start from a policy that solves some tasks (built once by a cold-start
run of the quickstart into DIR/policy, reused by later invocations; ``--prep-demos 0`` uses the random initial
model), and each has its own short cold start (16 demonstrations, an SFT checkpoint after each update), so a fault
can land in the demonstrations, the SFT or the RL steps. Prints a table per kind: faults injected, survived, lost,
runs, seconds of campaign per fault; exits 1 when a fault was lost, a run that got no fault broke an invariant, or
the campaign itself could not go on (its row says which).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

from _quickstart import ROOT, run_quickstart  # benchmarks/ is sys.path[0] when run as a script

from pipeline.cli.invariants import RunReport, check_run, containers_of, process_start
from pipeline.core.eventlog import EventLogError, EventLogReader
from pipeline.core.runfiles import run_tag, safe_name
from pipeline.messages import ActorStopped, RolloutFinished
from pipeline.rollout.sandbox.local import MARKER_ID, MARKER_RUN
from pipeline.rollout.sandbox.util import run_prefix

KINDS = {"runpy": "kill -9 run.py", "engine": "kill -9 engine", "proxy_worker": "kill -9 proxy worker",
         "sandbox": "kill -9 sandbox", "ray_node": "Ray node lost"}
EXIT_WAIT_S = 60.0  # a run whose engine or proxy worker died must have exited by then ("at once")
POLL_S = 0.2
T = TypeVar("T")

# The run's shape: a short cold start from the prepared policy (an SFT checkpoint after each of its 4 updates), then
# RL steps of 4 groups x 4 rollouts, a checkpoint per step. --steps sets the RL steps.
SHAPE = ["scheduler.sft_groups=16", "scheduler.sft_tasks.count=16", "tree.sft_pack=8", "learner.sft_epochs=2",
         "learner.sft_checkpoint_every=1", "scheduler.group_size=4", "run.groups_per_step=4",
         "scheduler.tasks.count=24", "learner.checkpoint_every=1"]
RAY_SHAPE = ['sandbox.backend="ray"', 'sandbox.docker.network="none"', 'sandbox.docker.verifier_network="none"',
             'sandbox.docker.build_network="none"', "sandbox.docker.cpus=1.0", 'sandbox.docker.memory="1g"',
             "sandbox.ray.node_check_s=2", "sandbox.concurrency=4"]


# ------------------------------------------------------------------------------------------------- processes
def _table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time) of every process (/proc)."""
    out = {}
    for e in os.listdir("/proc"):
        if not e.isdigit():
            continue
        try:
            raw = Path(f"/proc/{e}/stat").read_text()
        except OSError:
            continue
        f = raw[raw.rindex(")") + 2:].split()
        out[int(e)] = (int(f[1]), int(f[19]))
    return out


def descendants(root: int) -> dict[int, int]:
    """pid -> start time of every descendant of ``root`` (its parent chain leads to it)."""
    table = _table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out[pid] = table[pid][1]
        todo += children.get(pid, [])
    return out


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def env_value(pid: int, name: str) -> str | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = name.encode() + b"="
    return next((e[len(prefix):].decode(errors="replace") for e in env if e.startswith(prefix)), None)


def kill(pid: int, start: int) -> bool:
    """SIGKILL ``pid`` if it is still the process that started at ``start``; whether it was sent."""
    if process_start(pid) != start:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


# ------------------------------------------------------------------------------------------------------ a run
@dataclass
class Fault:
    kind: str
    run: str
    attempt: int
    at_s: float  # seconds into the attempt
    target: str
    exit_s: float | None = None  # engine, proxy worker: from the kill to run.py's exit
    rollout: str = ""  # sandbox: the rollout whose sandbox was killed
    broke: list[str] = field(default_factory=list)


@dataclass
class Run:
    """One run folder and its attempts (a start, then resumes), each a run.py child of this process."""

    dir: Path
    sets: list[str]
    steps: int
    seen: dict[int, int] = field(default_factory=dict)  # every descendant ever seen: pid -> start time
    attempts: int = 0
    proc: subprocess.Popen | None = None
    t0: float = 0.0

    @property
    def name(self) -> str:
        return self.dir.name

    def start(self, resume: bool = False) -> None:
        cmd = [sys.executable, "run.py"]
        if resume:
            cmd += ["--resume", str(self.dir), "--no-watch"]
        else:
            cmd += ["--experiment", "quickstart", "--run-dir", str(self.dir), "--no-watch", "--set",
                    'monitor.display="off"'] + [a for s in self.sets for a in ("--set", s)]
        self.attempts += 1
        console = self.dir.parent / f"{self.name}.console-{self.attempts}.txt"
        with console.open("wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        self.t0 = time.monotonic()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def age(self) -> float:
        return time.monotonic() - self.t0

    def scan(self) -> dict[int, int]:
        """The live descendants of run.py now (remembered for the leftover check)."""
        if not self.alive:
            return {}
        assert self.proc is not None
        now = descendants(self.proc.pid)
        self.seen.update(now)
        return now

    def window(self, longest: float, starting: bool = True) -> float:
        """Seconds in which a fault lands at a random moment: what is likely left of the run (its RL steps to go at
        the pace of its checkpoints so far, 4 s each before there are two, and 10 s to start while ``starting``),
        at most ``longest``."""
        marks = sorted(d.stat().st_mtime for d in (self.dir / "checkpoints").glob("step[0-9]*[0-9]"))
        pace = (marks[-1] - marks[0]) / (len(marks) - 1) if len(marks) > 1 else 4.0
        return max(2.0, min(longest, 10.0 * starting + (self.steps - len(marks)) * pace))

    def finishing(self) -> bool:
        """Its last RL step is checkpointed: the run is stopping on its own; no fault goes in now."""
        return (self.dir / "checkpoints" / f"step{self.steps:05d}").is_dir()

    def wait_until(self, done: Callable[[], bool], timeout: float = float("inf")) -> bool:
        """Poll (scanning the processes) until ``done()``, the run's end or ``timeout``; whether ``done()``."""
        deadline = time.monotonic() + timeout
        while self.alive and time.monotonic() < deadline:
            self.scan()
            if done():
                return True
            time.sleep(POLL_S)
        return False

    def sleep(self, seconds: float) -> None:
        """Wait (scanning the processes) ``seconds``, or until the run ends or begins to finish."""
        deadline = time.monotonic() + seconds
        self.wait_until(lambda: self.finishing() or time.monotonic() >= deadline)

    def wait_for(self, get: Callable[[], T]) -> T | None:
        """Poll until ``get()`` gives something, which is returned; None when the run ended or began to finish
        first."""
        while self.alive and not self.finishing():
            self.scan()
            if value := get():
                return value
            time.sleep(POLL_S)
        return None

    def wait_end(self, timeout: float) -> int | None:
        """run.py's exit code once it ends on its own; None (killed) when it did not within ``timeout``."""
        self.wait_until(lambda: False, timeout)
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            return None
        return self.proc.returncode

    def stop(self) -> None:
        """End an attempt the campaign cannot go on with: SIGTERM (the run stops cleanly), then SIGKILL."""
        if self.alive:
            assert self.proc is not None
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def console_tail(self, n: int = 1500) -> str:
        text = (self.dir.parent / f"{self.name}.console-{self.attempts}.txt").read_text(errors="replace")
        return text[-n:]


def _of_module(procs: dict[int, int], module: str) -> dict[int, int]:
    return {p: s for p, s in procs.items() if module in cmdline(p)}


# --------------------------------------------------------------------------------- faults that stop the run
# the target's module in its command line; what the run's crash must say (while the engine loads, its death is
# reported as a failed start, not by the watchdog: the exit code is what both say)
CRASH = {"engine": ("pipeline.serving.embedded", "engine"), "proxy_worker": ("pipeline.serving.proxy_workers",
                                                                            "WorkerDied")}


def next_target(kind: str, run: Run, rng: random.Random, window: float) -> tuple[int, int] | None:
    """Wait for a random moment of the attempt and return the process to kill then: (pid, start); None when the
    run ended or began to finish first."""
    assert run.proc is not None
    if kind == "runpy":
        run.sleep(rng.uniform(1.0, run.window(window)))
        if not run.alive or run.finishing():
            return None
        return run.proc.pid, process_start(run.proc.pid) or 0
    module = CRASH[kind][0]
    if run.wait_for(lambda: _of_module(run.scan(), module)) is None:
        return None
    run.sleep(rng.uniform(0.0, run.window(window, starting=False)))  # its target is up: the run has started
    targets = _of_module(run.scan(), module)
    if not run.alive or run.finishing() or not targets:
        return None
    pid = rng.choice(sorted(targets))
    return pid, targets[pid]


def inject_stop(kind: str, run: Run, pid: int, start: int) -> Fault | None:
    """Kill ``pid``; for the engine and a proxy worker, check that the run failed at once, naming it."""
    assert run.proc is not None
    label = "run.py" if kind == "runpy" else " ".join(cmdline(pid)[2:5])
    fault = Fault(kind, run.name, run.attempts, round(run.age, 1), f"pid {pid} ({label})")
    if not kill(pid, start):
        return None
    t = time.monotonic()
    if kind == "runpy":
        run.proc.wait()
        return fault
    try:
        rc = run.proc.wait(timeout=EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        fault.broke.append(f"the run did not stop within {EXIT_WAIT_S:.0f} s of the kill")
        run.proc.kill()
        run.proc.wait()
        return fault
    fault.exit_s = round(time.monotonic() - t, 1)
    if rc != 1:
        fault.broke.append(f"run.py exited {rc}, not 1")
    fault.broke += _crash_named(run, kind, cmdline_worker(label))
    return fault


def cmdline_worker(label: str) -> str:
    """The worker index in a proxy worker's command line ("... --worker 1")."""
    parts = label.split()
    return parts[parts.index("--worker") + 1] if "--worker" in parts else ""


def _crash_named(run: Run, kind: str, worker: str) -> list[str]:
    """What is wrong with how the run recorded its crash (nothing: one actor crashed, with the expected error)."""
    try:
        stops = [e.msg for e in EventLogReader(run.dir / "events.msgpack") if isinstance(e.msg, ActorStopped)]
    except EventLogError as e:
        return [f"the event log does not read: {e}"]
    crashed = [s for s in stops if s.reason == "crashed"]
    if not crashed:
        return ["no actor stopped as crashed in the event log"]
    err = crashed[-1].error
    want = [CRASH[kind][1], "exited with code -9"] + ([f"proxy worker {worker}"] if kind == "proxy_worker" else [])
    missing = [w for w in want if w not in err]
    return [f"the crash does not say {', '.join(missing)}: {err[:300]}"] if missing else []


def stop_episode(kind: str, run: Run, want: int, rng: random.Random, args: argparse.Namespace) -> list[Fault]:
    """run.py, the engine or a proxy worker: kill, resume, kill again ... then let the run finish."""
    faults: list[Fault] = []
    run.start()
    while len(faults) < want:
        target = next_target(kind, run, rng, args.window)
        if target is None:
            break
        fault = inject_stop(kind, run, *target)
        if fault is None:  # it ended meanwhile
            continue
        faults.append(fault)
        print(f"  {run.name}: {KINDS[kind]} #{len(faults)} at {fault.at_s} s of attempt {fault.attempt}, "
              f"{fault.target}" + (f"; exited in {fault.exit_s} s" if fault.exit_s is not None else ""), flush=True)
        run.start(resume=True)  # also after a fault that broke its expectation: the run's invariants still count
    return faults


# ------------------------------------------------------------------------------------------------ sandboxes
def live_sandboxes(run: Run) -> dict[str, dict[int, int]]:
    """Sandbox id -> its processes (pid -> start), for the run's live harness processes (environment markers)."""
    tag = run_tag(run.dir)
    out: dict[str, dict[int, int]] = {}
    for pid, start in run.scan().items():
        if env_value(pid, MARKER_RUN) == tag and (sid := env_value(pid, MARKER_ID)):
            out.setdefault(sid, {})[pid] = start
    return out


def rollout_of(run: Run, procs: dict[int, int]) -> str:
    """The rollout whose folder a sandbox's processes work in (``bridle-<tag>_<rollout>-<random>/app``)."""
    prefix = run_prefix(run_tag(run.dir))
    for pid in procs:
        with contextlib.suppress(OSError):
            name = Path(os.readlink(f"/proc/{pid}/cwd")).parent.name
            if name.startswith(prefix):
                return name[len(prefix):].rsplit("-", 1)[0]
    return ""


def sandbox_episode(run: Run, want: int, rng: random.Random, args: argparse.Namespace) -> list[Fault]:
    """Kill a random live sandbox every few seconds while the run goes on."""
    faults: list[Fault] = []
    run.start()
    while len(faults) < want and run.alive:
        run.sleep(rng.uniform(0.5, max(1.0, run.window(args.window) / (want - len(faults) + 1))))
        boxes = run.wait_for(lambda: live_sandboxes(run))
        if boxes is None:
            break
        sid = rng.choice(sorted(boxes))
        procs = boxes[sid]
        rollout = rollout_of(run, procs)
        at = round(run.age, 1)
        sent = [kill(p, s) for p, s in procs.items()]  # every process of the sandbox
        if not any(sent):
            continue
        faults.append(Fault("sandbox", run.name, run.attempts, at, f"{len(procs)} process(es) of sandbox {sid}",
                            rollout=rollout))
        print(f"  {run.name}: {KINDS['sandbox']} #{len(faults)} at {at} s: rollout {rollout}", flush=True)
    return faults


def check_killed_rollouts(run: Run, faults: list[Fault]) -> None:
    """A killed sandbox's rollout ends with a failed status (never ok)."""
    try:
        ended = {e.msg.rollout_id: e.msg.status for e in EventLogReader(run.dir / "events.msgpack")
                 if isinstance(e.msg, RolloutFinished)}
    except EventLogError:
        return  # the run's own check reports the log
    for f in faults:
        status = ended.get(f.rollout)
        if not f.rollout:
            f.broke.append("the killed sandbox's rollout could not be named")
        elif status is None:
            f.broke.append(f"rollout {f.rollout} of the killed sandbox never finished")
        elif status == "ok":
            f.broke.append(f"rollout {f.rollout} of the killed sandbox finished ok")
        else:
            f.target += f" -> {status}"


# ---------------------------------------------------------------------------------------------------- Ray
def ray_unavailable() -> str:
    """Why a Ray node cannot be lost here ("" when it can)."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed (pip install -e '.[ray]')"
    if shutil.which("ray", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")) is None:
        return "the ray CLI is not installed"
    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True,
                                                        check=False).returncode:
        return "no Docker engine answers (the Ray backend runs Docker sandboxes)"
    if subprocess.run(["docker", "image", "inspect", "bridle-whitebox"], capture_output=True,
                      check=False).returncode:
        return "the sandbox images are not built (python run.py --build-images)"
    return ""


def _node_running(tag: str, node_id: str) -> bool:
    out = subprocess.run(["docker", "ps", "-q", "--filter", f"label=bridle.run={tag}", "--filter",
                          "label=bridle.role=harness", "--filter", f"label=bridle.ray_node={node_id}"],
                         capture_output=True, text=True, check=False).stdout
    return bool(out.split())


def _new_worker_id(known: set[str], node, timeout: float = 120.0) -> str:
    """The Ray id of the worker node that joined last (alive, named node_worker, none of ``known``)."""
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node.proc.poll() is not None:
            raise RuntimeError(f"ray start (worker) exited: {node.log.read_text(errors='replace')[-2000:]}")
        ids = [n["NodeID"] for n in ray.nodes() if n["Alive"] and "node_worker" in n["Resources"]
               and n["NodeID"] not in known]
        if ids:
            return ids[0]
        time.sleep(0.5)
    raise TimeoutError(f"the new Ray worker node did not join within {timeout:.0f} s")


def ray_episode(run: Run, want: int, rng: random.Random, args: argparse.Namespace) -> list[Fault]:
    """Lose the worker node while a sandbox of it runs; a new worker joins; again ... while the run goes on."""
    sys.path.insert(0, str(ROOT))  # tests/ is no package on the path when this runs as a script
    from tests.helpers import raycluster as rc

    for attempt in range(3):  # ray start may lose a race for a port it was given
        try:
            cluster = rc.start_cluster(slots=2)
            break
        except (RuntimeError, TimeoutError):
            if attempt == 2:
                raise
    dead: list[rc.Node] = []
    faults: list[Fault] = []
    try:
        worker = _new_worker_id(set(), cluster.worker)
        run.sets = [*run.sets, f'sandbox.ray.address="{cluster.address}"',
                    f'sandbox.workdir="{run.dir.parent / (run.name + "-work")}"']
        run.start()
        tag = run_tag(run.dir)
        while len(faults) < want and run.alive:
            if not run.wait_for(partial(_node_running, tag, worker)):
                break
            run.sleep(rng.uniform(0.0, 2.0))
            if not run.alive or run.finishing():
                break
            at = round(run.age, 1)
            cluster.worker.kill()  # its whole process group: raylet, workers, the relay
            dead.append(cluster.worker)
            faults.append(Fault("ray_node", run.name, run.attempts, at, f"worker node {worker[:12]}"))
            print(f"  {run.name}: {KINDS['ray_node']} #{len(faults)} at {at} s: node {worker[:12]}", flush=True)
            cluster.worker = rc.start_worker(cluster.address, 2)
            worker = _new_worker_id({f.target.split()[-1] for f in faults} | {worker}, cluster.worker)
        run.wait_end(args.timeout)
    finally:
        cluster.stop()
        for node in dead:
            shutil.rmtree(node.temp_dir, ignore_errors=True)
    return faults


def lost_node_leftovers(run: Run, faults: list[Fault]) -> list[str]:
    """What the lost nodes left (their relay folders; their containers, which the next rollout on the host reaps
    only if one runs): on a real cluster it sits on the lost machine. Named, then removed from this one."""
    tag = run_tag(run.dir)
    nodes = [f.target.split()[-1] for f in faults]
    notes = []
    for node in nodes:
        for d in Path(tempfile.gettempdir()).glob(f"bridle-relay-{safe_name(tag, 24)}-{node}*"):
            notes.append(f"relay folder {d.name}")
            shutil.rmtree(d, ignore_errors=True)
    for cid in containers_of(tag):
        label = subprocess.run(["docker", "inspect", "-f", '{{index .Config.Labels "bridle.ray_node"}}', cid],
                               capture_output=True, text=True, check=False).stdout.strip()
        if any(label.startswith(n) for n in nodes):
            notes.append(f"container {cid[:12]}")
            subprocess.run(["docker", "rm", "-f", cid], capture_output=True, check=False)
    return notes


def lost_rollouts(run: Run) -> int:
    """Rollouts that ended as sandbox_error because their node was lost (log.jsonl: ray_rollout_lost)."""
    n = 0
    with contextlib.suppress(OSError):
        for line in (run.dir / "log.jsonl").read_text(errors="replace").splitlines():
            n += '"ray_rollout_lost"' in line
    return n


EPISODES: dict[str, Callable[..., list[Fault]]] = {"sandbox": sandbox_episode, "ray_node": ray_episode}


# ------------------------------------------------------------------------------------------------ campaign
@dataclass
class KindResult:
    kind: str
    faults: list[Fault] = field(default_factory=list)
    runs: int = 0
    wall_s: float = 0.0
    na: str = ""
    error: str = ""  # what stopped the campaign in this kind (not a fault of bridle's: a cluster that did not start)
    notes: list[str] = field(default_factory=list)
    reports: list[dict] = field(default_factory=list)
    left_on_nodes: list[str] = field(default_factory=list)  # ray_node: what lost nodes left behind
    lost_rollouts: int = 0  # ray_node: rollouts that ended as sandbox_error with their node
    unfaulted: list[str] = field(default_factory=list)  # what broke in a run that got no fault

    def summary_notes(self) -> list[str]:
        out = sorted(set(self.notes))
        if self.kind == "ray_node" and self.faults:
            out.append(f"{self.lost_rollouts} rollout(s) ended as sandbox_error with their node")
        if self.left_on_nodes:
            kinds = Counter(x.split()[0] for x in self.left_on_nodes)
            out.append("left on the lost nodes, removed here (as test_ray_e2e does): "
                       + ", ".join(f"{n} {k} folder(s)" if k == "relay" else f"{n} {k}(s)" for k, n in kinds.items()))
        return out


def judge(run: Run, faults: list[Fault], rc: int | None) -> tuple[RunReport, list[str]]:
    """The run's end and its invariants, charged to each of its faults; returns the report and what broke."""
    report = check_run(run.dir, pids=run.seen.items())
    broke = [f"{inv}: {d}" for inv, ds in report.broken().items() for d in ds]
    if rc != 0:
        tail = run.console_tail().strip().splitlines()[-3:]
        broke.insert(0, f"the run ended with exit code {rc}: {' | '.join(tail)}")
    for f in faults:
        f.broke += broke
    return report, broke


def run_kind(kind: str, want: int, rng: random.Random, args: argparse.Namespace, policy: Path) -> KindResult:
    res = KindResult(kind)
    if kind == "ray_node" and (why := ray_unavailable()):
        res.na = why
        return res
    t0 = time.monotonic()
    sets = [f'run.model="{policy}"', *SHAPE, f"run.steps={args.steps}", *args.sets]
    if kind == "proxy_worker":
        sets.append("proxy.workers=2")
    if kind == "ray_node":
        sets += RAY_SHAPE
    while len(res.faults) < want and res.runs < want + 2:
        res.runs += 1
        run = Run(args.out / f"{kind}-{res.runs}", list(sets), args.steps)
        shutil.rmtree(run.dir, ignore_errors=True)
        n = min(args.per_run, want - len(res.faults))
        try:
            got = EPISODES.get(kind, partial(stop_episode, kind))(run, n, rng, args)
        except Exception as e:  # noqa: BLE001 — the table still prints, with what stopped the campaign
            res.error = f"{run.name}: {type(e).__name__}: {str(e)[:300]}"
            run.stop()
            break
        rc = run.wait_end(args.timeout) if run.proc is not None else None
        if kind == "sandbox":
            check_killed_rollouts(run, got)
        if kind == "ray_node" and got:
            res.left_on_nodes += lost_node_leftovers(run, got)
            res.lost_rollouts += lost_rollouts(run)
        report, broke = judge(run, got, rc)
        res.notes += report.notes
        if broke and not got:  # broken with no fault in it: nothing to charge it to, never to be missed
            res.unfaulted += [f"{run.name}: {b}" for b in broke]
        res.reports.append({"run": run.name, "exit_code": rc, "attempts": run.attempts, "steps": report.steps,
                            "rollouts": report.rollouts, "abandoned": report.abandoned, "failed": report.failed,
                            "calls": report.calls, "findings": [f"{x.invariant}: {x.detail}" for x in report.findings]})
        print(f"  {run.name}: {len(got)} fault(s), {run.attempts} attempt(s), exit {rc}, {report.steps} steps, "
              f"{report.rollouts} rollouts ({report.abandoned} abandoned, {report.failed} failed), "
              f"{len(report.findings)} finding(s)", flush=True)
        res.faults += got
        if not got and run.attempts == 1 and rc != 0:
            res.notes.append(f"{run.name} failed without a fault (exit {rc}); stopped this kind")
            break
    res.wall_s = time.monotonic() - t0
    return res


def prepare_policy(args: argparse.Namespace) -> Path:
    """A policy that solves some tasks: the quickstart's cold start (``--prep-demos`` demonstrations,
    ``--prep-epochs`` epochs) from its random initial model, built once into DIR/policy."""
    if args.policy:
        return args.policy
    model = args.out / "model"
    if args.prep_demos == 0:
        return model  # built by the first run ([experiment.build_model])
    policy = args.out / "policy"
    if (policy / "model.safetensors").is_file():
        return policy
    prep = args.out / "prep"
    shutil.rmtree(prep, ignore_errors=True)
    print(f"preparing the policy: a cold start of {args.prep_demos} demonstrations x {args.prep_epochs} epochs "
          f"into {policy}", flush=True)
    r = run_quickstart(prep, [f'run.model="{model}"', "experiment.build_model.tasks=60",
                              f"scheduler.sft_groups={args.prep_demos}", f"learner.sft_epochs={args.prep_epochs}",
                              "run.steps=0", "scheduler.tasks.count=8"])
    if r.returncode:
        raise SystemExit(f"the policy's cold start failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    latest = max(prep.glob("weights/v*"))
    shutil.copytree(latest, policy.with_name("policy.tmp"), dirs_exist_ok=True)
    policy.with_name("policy.tmp").rename(policy)
    return policy


# ------------------------------------------------------------------------------------------------- output
def table(results: list[KindResult]) -> str:
    lines = ["| fault | injected | survived | lost | runs | s / fault | what broke, notes |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    tot = Counter()
    for r in results:
        if r.na:
            lines.append(f"| {KINDS[r.kind]} | n/a | n/a | n/a | 0 | - | {r.na} |")
            continue
        lost = [f for f in r.faults if f.broke]
        n, ok = len(r.faults), len(r.faults) - len(lost)
        tot.update(injected=n, survived=ok, lost=len(lost))
        what = Counter(b.split(":")[0] if ":" in b else b for f in lost for b in f.broke)
        cells = [f"{k} ({v})" for k, v in what.most_common()] + r.summary_notes()
        if r.unfaulted:
            cells.insert(0, f"BROKEN WITHOUT A FAULT: {'; '.join(r.unfaulted)}")
        if r.error:
            cells.insert(0, f"CAMPAIGN ERROR, stopped after {n} fault(s): {r.error}")
        if n == 0:
            cells.insert(0, "no target seen: nothing injected")
        per = f"{r.wall_s / n:.1f}" if n else "-"
        lines.append(f"| {KINDS[r.kind]} | {n} | {ok} | {len(lost)} | {r.runs} | {per} | {'; '.join(cells)} |")
    lines.append(f"| total | {tot['injected']} | {tot['survived']} | {tot['lost']} | "
                 f"{sum(r.runs for r in results)} | - | |")
    return "\n".join(lines)


def details(results: list[KindResult]) -> str:
    out = []
    for r in results:
        for f in r.faults:
            if f.broke:
                out.append(f"- {KINDS[f.kind]} in {f.run} (attempt {f.attempt}, at {f.at_s} s, {f.target}):")
                out += [f"    {b}" for b in f.broke]
    return "\n".join(out)


def split(total: int, kinds: list[str]) -> dict[str, int]:
    """``total`` faults spread evenly over ``kinds`` (the first ones get one more)."""
    return {k: total // len(kinds) + (i < total % len(kinds)) for i, k in enumerate(kinds)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", type=int, default=50, help="faults in all, spread evenly over the kinds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    ap.add_argument("--per-run", type=int, default=4, help="faults injected into one run before it may finish")
    ap.add_argument("--steps", type=int, default=10, help="RL steps per run")
    ap.add_argument("--window", type=float, default=40.0,
                    help="a fault comes at a random moment of what is left of its run, at most this many seconds in")
    ap.add_argument("--timeout", type=float, default=900.0, help="longest a run may take to finish after its faults")
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "bridle-faults")
    ap.add_argument("--policy", type=Path, default=None, help="a policy folder to start from (default: prepared)")
    ap.add_argument("--prep-demos", type=int, default=128)
    ap.add_argument("--prep-epochs", type=int, default=10)
    ap.add_argument("--set", dest="sets", action="append", default=[], help="more --set for every run")
    ap.add_argument("--json", type=Path, default=None, help="write every fault and run report here")
    args = ap.parse_args()
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        ap.error(f"--kinds: unknown {unknown}; choose from {', '.join(KINDS)}")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    policy = prepare_policy(args)
    rng = random.Random(args.seed)
    plan = split(args.faults, kinds)
    print(f"fault campaign: seed {args.seed}, {args.faults} faults ({', '.join(f'{k} {n}' for k, n in plan.items())})"
          f", up to {args.per_run} per run; quickstart from {policy}, {args.steps} RL steps x 4 groups x 4 "
          f"rollouts; runs in {args.out}", flush=True)
    t0 = time.monotonic()
    results = []
    for kind in kinds:
        print(f"{KINDS[kind]}:", flush=True)
        results.append(run_kind(kind, plan[kind], rng, args, policy))
    print()
    print(table(results))
    broke = details(results)
    if broke:
        print("\nlost faults:\n" + broke)
    print(f"\ncampaign wall time {time.monotonic() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"seed": args.seed, "results": [asdict(r) for r in results]}, indent=1))
    failed = any(f.broke for r in results for f in r.faults) or any(r.error or r.unfaulted for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
