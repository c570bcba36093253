"""What must hold of a run that ended, however often it was killed and resumed: checked from its folder alone.

:func:`check_run` reads the event log (:class:`~pipeline.core.eventlog.EventLogReader`), ``metrics.jsonl``
(:func:`~pipeline.monitor.metrics.load_metrics`) and the learner's checkpoints, and reports each broken invariant
as a :class:`Finding`:

- ``log``: the event log reads to its end without damage or a cut tail.
- ``calls``: every started call (CallStarted) ended once (ModelCall or CallFailed), and nothing ended unstarted.
- ``rollouts``: every issued rollout finished once and was settled once; a training rollout is counted once in its
  group (trained, or left out with the status it finished with), a demonstration at most once (a pack lists only
  the demonstrations it trains on).
- ``steps``: every RL step up to the last checkpoint was trained once (one PolicyUpdated with a batch hash; a
  resume's re-announcement carries none), each checkpoint agrees with it, no step or group was trained twice, none
  past the last checkpoint, and the run reached ``[run].steps``.
- ``rows``: every step has one ``rl_step`` Metric in the log and a row in ``metrics.jsonl`` whose values are the
  log's (when a resume wrote a row again, the later row is the one that counts, as for every reader).
- ``leftovers``: nothing of the run is left outside its folder (:func:`leftovers`).

A kill cuts an attempt short: its rollouts in flight never finish and their calls never end. The resume issues
their groups again under new ids (``g00016-a1``, :class:`pipeline.rollout.scheduling.Issuer`), so a rollout of an
issue that a later issue of the same slot supersedes is *abandoned*, not lost; so is any other rollout (a
demonstration, an evaluation) issued before a resume and never finished. Checkpoints are written before their step is announced, so with ``[learner].checkpoint_every = 1`` no step
can be announced twice; with a larger interval a kill makes the steps after the last checkpoint train again, and
only checkpointed steps must then be trained exactly once.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec

from pipeline.core.eventlog import EventLogError, EventLogReader, LogHeader
from pipeline.core.logs import get_logger
from pipeline.core.runfiles import marked_pids, run_tag, safe_name
from pipeline.messages import (
    CallFailed,
    CallStarted,
    Event,
    GroupDropped,
    Metric,
    ModelCall,
    PolicyUpdated,
    RolloutFinished,
    RolloutRequest,
    SettledRollout,
    TreeGroup,
)
from pipeline.monitor.metrics import load_metrics, of_kind
from pipeline.rollout.sandbox.local import MARKER_RUN
from pipeline.rollout.sandbox.util import run_prefix
from pipeline.training.ranks import RANKS_MARKER

log = get_logger(component="invariants")

Invariant = Literal["log", "calls", "rollouts", "steps", "rows", "leftovers"]
INVARIANTS: tuple[Invariant, ...] = ("log", "calls", "rollouts", "steps", "rows", "leftovers")
MAX_EXAMPLES = 3  # ids quoted per finding; the count says how many there are


class Finding(msgspec.Struct, frozen=True):
    """One broken invariant, in words that name what broke (ids, steps, paths)."""

    invariant: Invariant
    detail: str


class RunReport(msgspec.Struct, kw_only=True):
    """What :func:`check_run` found, and what it counted on the way."""

    run_dir: str
    findings: list[Finding] = msgspec.field(default_factory=list)
    notes: list[str] = msgspec.field(default_factory=list)  # worth knowing, nothing broken
    steps: int = 0  # RL steps trained up to the last checkpoint
    rollouts: int = 0  # issued
    abandoned: int = 0  # issued, then cut short by a kill and issued again (or issued before a resume)
    failed: int = 0  # finished with a status other than ok
    calls: int = 0  # started

    @property
    def ok(self) -> bool:
        return not self.findings

    def broken(self) -> dict[str, list[str]]:
        """Invariant -> what broke it, for the invariants that broke."""
        out: dict[str, list[str]] = defaultdict(list)
        for f in self.findings:
            out[f.invariant].append(f.detail)
        return dict(out)


# --------------------------------------------------------------------------------------------- checkpoints
STATE_FILE = "learner_state.json"  # in each checkpoint folder (pipeline.training.learner), read as launch.py does


class Announced(msgspec.Struct, kw_only=True):
    """What a checkpoint keeps of its step's announcement (the learner actor's ``Announcement``)."""

    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    batch_hash: str = ""
    groups: list[str] = msgspec.field(default_factory=list)


class CheckpointExtra(msgspec.Struct, kw_only=True):
    steps_done: int = 0
    announce: Announced | None = None


class CheckpointState(msgspec.Struct, kw_only=True):
    """A checkpoint's ``learner_state.json`` (the fields checked here)."""

    step: int
    version: int
    extra: CheckpointExtra = msgspec.field(default_factory=CheckpointExtra)


def read_checkpoints(run_dir: Path) -> tuple[dict[int, CheckpointState], list[str]]:
    """The RL step checkpoints of ``run_dir`` (``checkpoints/step00012``) by step, and what could not be read."""
    out: dict[int, CheckpointState] = {}
    bad: list[str] = []
    for d in sorted((run_dir / "checkpoints").glob("step*")):
        if not re.fullmatch(r"step\d{5}", d.name):
            continue
        try:
            out[int(d.name.removeprefix("step"))] = msgspec.json.decode((d / STATE_FILE).read_bytes(),
                                                                         type=CheckpointState)
        except (OSError, msgspec.DecodeError) as e:
            bad.append(f"{d.name}: {e}")
    return out, bad


# ---------------------------------------------------------------------------------------------- leftovers
def leftovers(run_dir: str | Path, pids: Iterable[tuple[int, int]] = ()) -> dict[str, list[str]]:
    """What the run keeps outside its folder and is still there, found by its tag as a restart finds it: rollout
    folders (verifiers' included) and proxy or learner socket folders in the temp dir, Ray relay folders, sandbox
    processes and learner ranks (their environment markers), containers (label ``bridle.run``, when a Docker CLI
    answers), engine port files and cut checkpoints in the folder. ``pids``: (pid, start time in clock ticks since
    boot, as /proc/PID/stat has it) of processes the caller saw the run start; those still alive are listed too.
    Only the kinds with something left."""
    run_dir = Path(run_dir)
    tag = run_tag(run_dir)
    tmp = Path(tempfile.gettempdir())
    found: dict[str, list[str]] = {
        "workspaces": [str(p) for p in sorted(tmp.glob(f"{run_prefix(tag)}*"))],
        "socket_folders": [str(p) for p in sorted(tmp.glob(f"bridle.sock-{tag}_*"))],
        "relay_folders": [str(p) for p in sorted(tmp.glob(f"bridle-relay-{safe_name(tag, 24)}-*"))],
        "processes": [f"pid {p} ({MARKER_RUN})" for p in marked_pids(f"{MARKER_RUN}={tag}".encode())]
        + [f"pid {p} ({RANKS_MARKER})" for p in marked_pids(f"{RANKS_MARKER}={tag}".encode())]
        + [f"pid {p} (started by the run)" for p, start in pids if process_start(p) == start],
        "containers": containers_of(tag),
        "engine_ports": [str(p) for p in sorted([*run_dir.glob("*.port"), *run_dir.glob("bridle-engine-port-*")])],
        "cut_checkpoints": [str(p) for p in sorted((run_dir / "checkpoints").glob("*.tmp"))],
    }
    return {k: v for k, v in found.items() if v}


def process_start(pid: int) -> int | None:
    """A process's start time (clock ticks since boot, /proc/PID/stat field 22): with the pid, its identity.
    None when it is gone (or is a zombie, which holds nothing but its exit status)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return None if fields[0] == "Z" else int(fields[19])


def containers_of(tag: str) -> list[str]:
    """Ids of the containers labelled with the run's tag, running or not; empty without a Docker CLI that
    answers."""
    if shutil.which("docker") is None:
        return []
    try:
        out = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=bridle.run={tag}"], capture_output=True,
                             text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    return out.stdout.split() if out.returncode == 0 else []


# ------------------------------------------------------------------------------------------ the event log
_SLOT = re.compile(r"g(\d{5})(?:-a(\d+))?")  # a training group's slot and resume attempt (Issuer.next)


def _examples(ids: Iterable[Any]) -> str:
    items = sorted(str(i) for i in ids)
    more = f" and {len(items) - MAX_EXAMPLES} more" if len(items) > MAX_EXAMPLES else ""
    return ", ".join(items[:MAX_EXAMPLES]) + more


@dataclass
class Ledger:
    """One pass over the log: who was issued, finished, settled, counted, trained; which calls started and ended."""

    proxies: set[str]  # actor names of kind "proxy": their RolloutRequests are forwards, not issues
    issued: dict[str, tuple[int, RolloutRequest]] = field(default_factory=dict)  # rollout id -> (position, request)
    issued_twice: list[str] = field(default_factory=list)
    finished: dict[str, list[RolloutFinished]] = field(default_factory=lambda: defaultdict(list))
    settled: Counter[str] = field(default_factory=Counter)
    counted: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # rollout -> statuses in groups
    started: Counter[str] = field(default_factory=Counter)  # call id -> CallStarted records
    ended: Counter[str] = field(default_factory=Counter)  # call id -> ModelCall / CallFailed records
    call_rollout: dict[str, str] = field(default_factory=dict)
    updates: list[PolicyUpdated] = field(default_factory=list)
    rl_metrics: dict[int, list[Metric]] = field(default_factory=lambda: defaultdict(list))
    resumes: list[int] = field(default_factory=list)  # positions of the first issue of each resume attempt
    _attempt: int = 0

    def add(self, pos: int, ev: Event) -> None:
        m = ev.msg
        if isinstance(m, RolloutRequest):
            self._request(pos, ev.src.split(".")[0], m)
        elif isinstance(m, CallStarted):
            self.started[m.call_id] += 1
            self.call_rollout[m.call_id] = m.rollout_id
        elif isinstance(m, ModelCall | CallFailed):
            self.ended[m.call_id] += 1
            self.call_rollout.setdefault(m.call_id, m.rollout_id)
        elif isinstance(m, RolloutFinished):
            self.finished[m.rollout_id].append(m)
        elif isinstance(m, SettledRollout):
            self.settled[m.finished.rollout_id] += 1
        elif isinstance(m, TreeGroup | GroupDropped):
            self._group(m)
        elif isinstance(m, PolicyUpdated):
            self.updates.append(m)
        elif isinstance(m, Metric) and m.kind == "rl_step":
            self.rl_metrics[m.step].append(m)

    def _request(self, pos: int, actor: str, m: RolloutRequest) -> None:
        if actor in self.proxies:
            return
        if m.rollout_id in self.issued:
            self.issued_twice.append(m.rollout_id)
            return
        self.issued[m.rollout_id] = (pos, m)
        slot = _SLOT.match(m.group_id)
        attempt = int(slot.group(2) or 0) if slot else 0
        if attempt > self._attempt:
            self._attempt = attempt
            self.resumes.append(pos)

    def _group(self, g: TreeGroup | GroupDropped) -> None:
        if isinstance(g, TreeGroup):
            for r in g.rollouts:
                self.counted[r.rollout_id].append(r.status)
        for lo in g.left_out:
            self.counted[lo.rollout_id].append(lo.status)

    def abandoned(self) -> set[str]:
        """Rollouts a kill may have cut short: of an issue that a later issue of its slot supersedes, or (not a
        training slot's: a demonstration, an evaluation) unfinished and issued before a resume."""
        latest: dict[int, int] = {}
        for _, req in self.issued.values():
            if slot := _SLOT.match(req.group_id):
                j, a = int(slot.group(1)), int(slot.group(2) or 0)
                latest[j] = max(latest.get(j, 0), a)
        out = set()
        for rid, (pos, req) in self.issued.items():
            slot = _SLOT.match(req.group_id)
            if slot:
                if int(slot.group(2) or 0) < latest[int(slot.group(1))]:
                    out.add(rid)
            elif not self.finished.get(rid) and any(p > pos for p in self.resumes):
                out.add(rid)
        return out


def check_calls(led: Ledger, abandoned: set[str]) -> list[Finding]:
    """Every started call ended once; nothing ended that did not start."""
    out = []
    open_calls = [c for c in led.started if not led.ended[c] and led.call_rollout[c] not in abandoned]
    if open_calls:
        out.append(Finding("calls", f"{len(open_calls)} started call(s) never ended: {_examples(open_calls)}"))
    twice = [c for c, n in led.started.items() if n > 1]
    if twice:
        out.append(Finding("calls", f"{len(twice)} call(s) started twice: {_examples(twice)}"))
    ended_twice = [c for c, n in led.ended.items() if n > 1]
    if ended_twice:
        out.append(Finding("calls", f"{len(ended_twice)} call(s) ended twice: {_examples(ended_twice)}"))
    unstarted = [c for c in led.ended if not led.started[c]]
    if unstarted:
        out.append(Finding("calls", f"{len(unstarted)} call(s) ended without a start: {_examples(unstarted)}"))
    return out


def check_rollouts(led: Ledger, abandoned: set[str]) -> list[Finding]:
    """Every issued rollout finished and settled once; a training one counted once in its group (a demonstration at
    most once), with the status it finished with. Abandoned rollouts need none of it, but never finish twice."""
    out = []
    if led.issued_twice:
        out.append(Finding("rollouts", f"{len(led.issued_twice)} rollout id(s) issued twice: "
                                       f"{_examples(led.issued_twice)}"))
    unknown = [r for r in led.finished if r not in led.issued]
    if unknown:
        out.append(Finding("rollouts", f"{len(unknown)} rollout(s) finished that were never issued: "
                                       f"{_examples(unknown)}"))
    twice = [r for r, fs in led.finished.items() if len(fs) > 1]
    if twice:
        out.append(Finding("rollouts", f"{len(twice)} rollout(s) finished more than once: {_examples(twice)}"))
    live = {r: req for r, (_, req) in led.issued.items() if r not in abandoned}
    never = [r for r in live if not led.finished.get(r)]
    if never:
        out.append(Finding("rollouts", f"{len(never)} rollout(s) never finished (nor were counted as failed): "
                                       f"{_examples(never)}"))
    unsettled = [r for r in live if led.finished.get(r) and led.settled[r] != 1]
    if unsettled:
        out.append(Finding("rollouts", f"{len(unsettled)} finished rollout(s) not settled exactly once: "
                                       + _examples(f"{r} ({led.settled[r]}x)" for r in unsettled)))
    # a training group lists every rollout (trained or left out); a demonstration pack only those it trains on
    grouped = {r: req.purpose for r, req in live.items() if req.purpose in ("train", "sft") and led.finished.get(r)}
    uncounted = [r for r, purpose in grouped.items()
                 if len(led.counted.get(r, [])) > 1 or (purpose == "train" and not led.counted.get(r))]
    if uncounted:
        out.append(Finding("rollouts", f"{len(uncounted)} rollout(s) not counted exactly once in a group: "
                                       + _examples(f"{r} ({len(led.counted.get(r, []))}x)" for r in uncounted)))
    wrong = [r for r in grouped if len(led.counted.get(r, [])) == 1
             and led.counted[r][0] != led.finished[r][-1].status]
    if wrong:
        out.append(Finding("rollouts", f"{len(wrong)} rollout(s) counted with another status than they finished "
                                       "with: " + _examples(f"{r} ({led.finished[r][-1].status} counted as "
                                                            f"{led.counted[r][0]})" for r in wrong)))
    return out


def check_steps(led: Ledger, ckpts: dict[int, CheckpointState], steps: int, every: int) -> list[Finding]:
    """Every RL step up to the last checkpoint trained once, as its checkpoint says; nothing trained twice or
    past it; the run reached ``steps``."""
    out: list[Finding] = []
    last = max(ckpts, default=0)
    trained: dict[int, list[PolicyUpdated]] = defaultdict(list)
    for u in led.updates:
        if u.batch_hash:  # a resume announces its checkpoint's weights with none: nothing trained
            trained[u.step].append(u)
    if last < steps:
        out.append(Finding("steps", f"the run stopped after step {last} of {steps} (its last checkpoint)"))
    for s in range(1, last + 1):
        n = len(trained.get(s, []))
        if n == 0:
            out.append(Finding("steps", f"step {s} was never announced as trained (checkpointed: {s in ckpts})"))
        elif n > 1 and not _repeatable(s, ckpts, every):
            out.append(Finding("steps", f"step {s} was trained {n} times (batch hashes "
                                        f"{_examples(u.batch_hash[:12] for u in trained[s])})"))
    beyond = sorted(s for s in trained if s > last)
    if beyond:
        out.append(Finding("steps", f"step(s) {_examples(beyond)} announced as trained past the last checkpoint "
                                    f"(step {last})"))
    step0 = {u.batch_hash for u in trained.get(0, [])}
    if len(step0) > 1:
        out.append(Finding("steps", f"the cold start was announced with {len(step0)} different batches"))
    out += _checkpoints_agree(ckpts, trained)
    slots = Counter(int(m.group(1)) for u in led.updates if u.step >= 1 and u.batch_hash
                    and not _repeatable(u.step, ckpts, every) for g in set(u.groups) if (m := _SLOT.match(g)))
    again = sorted(j for j, n in slots.items() if n > 1)
    if again:
        out.append(Finding("steps", f"{len(again)} group slot(s) trained more than once: {_examples(again)}"))
    return out


def _repeatable(step: int, ckpts: dict[int, CheckpointState], every: int) -> bool:
    """Whether a kill may make ``step`` train again: it has no checkpoint, and checkpoints skip steps."""
    return every != 1 and step not in ckpts


def _checkpoints_agree(ckpts: dict[int, CheckpointState], trained: dict[int, list[PolicyUpdated]]) -> list[Finding]:
    out = []
    for s, st in sorted(ckpts.items()):
        if st.extra.steps_done != s:
            out.append(Finding("steps", f"checkpoint step{s:05d} says it holds {st.extra.steps_done} steps"))
        a = st.extra.announce
        if a is None or not trained.get(s):
            continue
        if a.batch_hash != trained[s][-1].batch_hash or a.groups != trained[s][-1].groups:
            out.append(Finding("steps", f"checkpoint step{s:05d} trained batch {a.batch_hash[:12]}, the log "
                                        f"announced {trained[s][-1].batch_hash[:12]}"))
    return out


_ROW_HEAD = ("t", "source", "kind", "step", "warnings")  # metrics.record's own keys; a value of that name is value_*


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def check_rows(led: Ledger, rows: list[dict[str, Any]], ckpts: dict[int, CheckpointState],
               every: int) -> tuple[list[Finding], list[str]]:
    """Each step up to the last checkpoint has one rl_step Metric in the log (more for a step trained again,
    :func:`_repeatable`) and a row in metrics.jsonl holding its values (the last row of a step is the one that
    counts); none past it. Returns the findings and notes."""
    last = max(ckpts, default=0)
    out: list[Finding] = []
    notes: list[str] = []
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in of_kind(rows, "rl_step"):
        by_step[int(r["step"])].append(r)
    missing = [s for s in range(1, last + 1) if not led.rl_metrics.get(s)]
    if missing:
        out.append(Finding("rows", f"{len(missing)} step(s) without an rl_step Metric in the event log: "
                                   f"{_examples(missing)}"))
    twice = [s for s, ms in led.rl_metrics.items() if len(ms) > 1 and not _repeatable(s, ckpts, every)]
    if twice:
        out.append(Finding("rows", f"step(s) {_examples(twice)} have more than one rl_step Metric in the log"))
    absent = [s for s in range(1, last + 1) if not by_step.get(s)]
    if absent:
        out.append(Finding("rows", f"{len(absent)} step(s) without a row in metrics.jsonl: {_examples(absent)}"))
    differ = [s for s in range(1, last + 1) if by_step.get(s) and led.rl_metrics.get(s)
              and not _row_holds(by_step[s][-1], led.rl_metrics[s][-1])]
    if differ:
        out.append(Finding("rows", f"metrics.jsonl rows of step(s) {_examples(differ)} differ from the log"))
    beyond = sorted({s for s in by_step if s > last} | {s for s in led.rl_metrics if s > last})
    if beyond:
        out.append(Finding("rows", f"rows of step(s) {_examples(beyond)} past the last checkpoint (step {last})"))
    again = [s for s, rs in by_step.items() if len(rs) > 1 and s <= last]
    if again:
        notes.append(f"metrics.jsonl holds a step's row more than once for step(s) {_examples(again)} (written "
                     "again by a resume; the later row counts)")
    return out, notes


def _row_holds(row: dict[str, Any], m: Metric) -> bool:
    return all(_same(row.get(f"value_{k}" if k in _ROW_HEAD else k), v) for k, v in m.values.items())


# ---------------------------------------------------------------------------------------------- the whole
def _graph(header: LogHeader) -> tuple[set[str], int, int]:
    """From the recorded config: the proxy actors' names, [run].steps and [learner].checkpoint_every."""
    conf = header.config
    actors = conf.get("graph", {}).get("actors", {})
    learners = [n for n, kind in actors.items() if kind == "learner"]
    every = int(conf.get(learners[0], {}).get("checkpoint_every", 1)) if learners else 1
    return {n for n, kind in actors.items() if kind == "proxy"}, int(conf.get("run", {}).get("steps", 0)), every


def check_run(run_dir: str | Path, *, pids: Iterable[tuple[int, int]] = ()) -> RunReport:
    """Check the invariants of the run in ``run_dir`` after it ended (see the module docstring); ``pids``: as for
    :func:`leftovers`."""
    run_dir = Path(run_dir)
    report = RunReport(run_dir=str(run_dir))
    try:
        reader = EventLogReader(run_dir / "events.msgpack")
        events = list(reader)
    except EventLogError as e:
        report.findings.append(Finding("log", str(e)))
        return report
    if reader.report.truncated_at is not None:
        report.findings.append(Finding("log", f"a cut tail: {reader.report.problem}"))
    proxies, steps, every = _graph(reader.header)
    led = Ledger(proxies=proxies)
    for pos, ev in enumerate(events):
        led.add(pos, ev)
    abandoned = led.abandoned()
    ckpts, unreadable = read_checkpoints(run_dir)
    report.findings += [Finding("steps", f"unreadable checkpoint {b}") for b in unreadable]
    report.findings += check_calls(led, abandoned) + check_rollouts(led, abandoned)
    report.findings += check_steps(led, ckpts, steps, every)
    metrics = run_dir / "metrics.jsonl"
    rows, notes = check_rows(led, load_metrics(metrics) if metrics.is_file() else [], ckpts, every)
    report.findings += rows
    report.notes += notes
    for kind, items in leftovers(run_dir, pids).items():
        report.findings.append(Finding("leftovers", f"{kind}: {_examples(items)}"))
    last = max(ckpts, default=0)
    report.steps, report.rollouts, report.abandoned = last, len(led.issued), len(abandoned)
    report.failed = sum(1 for fs in led.finished.values() if fs and fs[-1].status != "ok")
    report.calls = len(led.started)
    log.info("run checked", run_dir=str(run_dir), findings=len(report.findings), steps=last,
             rollouts=report.rollouts, abandoned=report.abandoned)
    return report
