"""The invariant checker (pipeline/cli/invariants.py) on hand-built run folders: a clean two-step run passes, a run
killed and resumed passes, and each broken invariant is reported, naming what broke."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import msgspec
import pytest

from pipeline.cli.invariants import check_run, process_start
from pipeline.core.eventlog import EventLogWriter, LogHeader
from pipeline.core.runfiles import run_tag
from pipeline.messages import (
    CallStarted,
    Event,
    LeftOut,
    Metric,
    ModelCall,
    PackedTree,
    PolicyUpdated,
    RolloutFinished,
    RolloutRequest,
    RolloutSummary,
    SettledRollout,
    TreeGroup,
    pack_f32,
    pack_i32,
)
from pipeline.monitor.metrics import record
from pipeline.rollout.sandbox.util import run_prefix

CONFIG = {"graph": {"actors": {"scheduler": "scheduler", "proxy": "proxy", "sandbox": "sandbox",
                               "collector": "collector", "tree": "tree", "learner": "learner"}},
          "run": {"steps": 2}, "learner": {"checkpoint_every": 1}}
EMPTY = PackedTree(tokens=b"", positions=b"", subtree_end=b"", pred=b"", trainable=b"", logprobs=b"", rollout=b"",
                   segment=b"")


def request(group: str, i: int = 0) -> RolloutRequest:
    return RolloutRequest(rollout_id=f"{group}-r{i}", group_id=group, index=i, group_size=2, task_id="t",
                          harness="whitebox", token="tok", policy_version=0)


def rollout(group: str, i: int, status: str = "ok", *, settle: bool = True, end_call: bool = True) -> list[Event]:
    """One rollout's records: issued, forwarded, one call, finished, settled."""
    req = request(group, i)
    rid, cid = req.rollout_id, f"{req.rollout_id}-c0"
    call = ModelCall(rollout_id=rid, call_id=cid, seq=0, protocol="chat", input_ids=pack_i32([1, 2]),
                     output_ids=pack_i32([3]), logprobs=pack_f32([-0.5]))
    fin = RolloutFinished(rollout_id=rid, group_id=group, status=status, reward=1.0)  # type: ignore[arg-type]
    evs = [Event(0.0, "scheduler.requests", req), Event(0.0, "proxy.rollouts", req),
           Event(0.0, "proxy.calls", CallStarted(rollout_id=rid, call_id=cid, seq=0, t=0.0))]
    if end_call:
        evs.append(Event(0.0, "proxy.calls", call))
    evs.append(Event(0.0, "sandbox.finished", fin))
    if settle:
        evs.append(Event(0.0, "collector.settled", SettledRollout(request=req, finished=fin, calls=[call])))
    return evs


def group(gid: str) -> TreeGroup:
    """Rollout 0 trained, rollout 1 left out with its harness_error."""
    return TreeGroup(group_id=gid, task_id="t", harness="whitebox",
                     rollouts=[RolloutSummary(rollout_id=f"{gid}-r0", reward=1.0, status="ok")], packed=EMPTY,
                     left_out=[LeftOut(rollout_id=f"{gid}-r1", status="harness_error")])


def step(s: int, gid: str) -> tuple[list[Event], Metric, PolicyUpdated]:
    """A step's records: its group's two rollouts (the second failed), the group, the metric, the update."""
    metric = Metric(source="learner.rl", kind="rl_step", step=s, values={"reward": 0.5, "step": float(s)})
    update = PolicyUpdated(version=s, step=s, batch_hash=f"hash{s}", groups=[gid])
    evs = [*rollout(gid, 0), *rollout(gid, 1, "harness_error"), Event(0.0, "tree.groups", group(gid)),
           Event(0.0, "learner.metrics", metric), Event(0.0, "learner.updates", update)]
    return evs, metric, update


def write_run(run_dir: Path, events: list[Event], rows: list[Metric], ckpts: list[PolicyUpdated],
              config: dict | None = None) -> Path:
    """A run folder: the event log, metrics.jsonl (``rows``) and a checkpoint per update in ``ckpts``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    header = LogHeader(schema_version=2, run_id=run_tag(run_dir), created=0.0, config=config or CONFIG)
    with EventLogWriter(run_dir / "events.msgpack", header) as w:
        for ev in events:
            w.append(ev.src, ev.msg, t=ev.t)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record(m, 1.0)) + "\n" for m in rows))
    for u in ckpts:
        d = run_dir / "checkpoints" / f"step{u.step:05d}"
        d.mkdir(parents=True)
        state = {"step": u.step, "version": u.version,
                 "extra": {"steps_done": u.step, "announce": {"metrics": {"reward": 0.5, "step": float(u.step)},
                                                             "warnings": [], "batch_hash": u.batch_hash,
                                                             "groups": u.groups}}}
        (d / "learner_state.json").write_text(json.dumps(state))
    return run_dir


def clean() -> tuple[list[Event], list[Metric], list[PolicyUpdated]]:
    e1, m1, u1 = step(1, "g00000")
    e2, m2, u2 = step(2, "g00001")
    return [*e1, *e2], [m1, m2], [u1, u2]


def broken(report) -> dict[str, list[str]]:
    return report.broken()


def test_a_clean_run_holds_every_invariant(tmp_path):
    events, rows, updates = clean()
    report = check_run(write_run(tmp_path / "run", events, rows, updates))
    assert report.findings == [] and report.notes == []
    assert (report.steps, report.rollouts, report.abandoned, report.failed, report.calls) == (2, 4, 0, 2, 4)


def test_a_run_killed_and_resumed_holds_every_invariant(tmp_path):
    """Killed during step 2: its second rollout never finished and its call never ended, the first was finished
    but not settled; the resume re-announced step 1 (no batch hash), issued the group again as g00001-a1, trained
    it. Nothing of the killed issue is owed."""
    e1, m1, u1 = step(1, "g00000")
    killed = [*rollout("g00001", 0, settle=False), *rollout("g00001", 1, settle=False, end_call=False)[:3]]
    resumed = [Event(0.0, "learner.updates", PolicyUpdated(version=1, step=1))]
    e2, m2, u2 = step(2, "g00001-a1")
    report = check_run(write_run(tmp_path / "run", [*e1, *killed, *resumed, *e2], [m1, m2], [u1, u2]))
    assert report.findings == []
    assert report.abandoned == 2


def drop(events: list[Event], pred) -> list[Event]:
    out = [e for e in events if not pred(e.msg)]
    assert len(out) == len(events) - 1, "the mutation must remove exactly one record"
    return out


def test_a_call_that_never_ended(tmp_path):
    events, rows, updates = clean()
    events = drop(events, lambda m: isinstance(m, ModelCall) and m.call_id == "g00001-r0-c0")
    assert broken(check_run(write_run(tmp_path / "run", events, rows, updates))) == {
        "calls": ["1 started call(s) never ended: g00001-r0-c0"]}


def test_a_rollout_that_never_finished_nor_settled(tmp_path):
    events, rows, updates = clean()
    events = drop(events, lambda m: isinstance(m, RolloutFinished) and m.rollout_id == "g00000-r1")
    events = drop(events, lambda m: isinstance(m, SettledRollout) and m.finished.rollout_id == "g00000-r1")
    assert broken(check_run(write_run(tmp_path / "run", events, rows, updates))) == {
        "rollouts": ["1 rollout(s) never finished (nor were counted as failed): g00000-r1"]}


def test_a_rollout_finished_twice_unsettled_or_uncounted(tmp_path):
    events, rows, updates = clean()
    twice = next(e for e in events if isinstance(e.msg, RolloutFinished) and e.msg.rollout_id == "g00001-r1")
    events = drop(events, lambda m: isinstance(m, SettledRollout) and m.finished.rollout_id == "g00000-r0")
    events.insert(events.index(twice), twice)
    events = [Event(e.t, e.src, msgspec.structs.replace(e.msg, left_out=[]))
              if isinstance(e.msg, TreeGroup) and e.msg.group_id == "g00001" else e for e in events]
    assert broken(check_run(write_run(tmp_path / "run", events, rows, updates))) == {"rollouts": [
        "1 rollout(s) finished more than once: g00001-r1",
        "1 finished rollout(s) not settled exactly once: g00000-r0 (0x)",
        "1 rollout(s) not counted exactly once in a group: g00001-r1 (0x)"]}


def test_a_failed_rollout_counted_as_trained(tmp_path):
    events, rows, updates = clean()
    events = [Event(e.t, e.src, msgspec.structs.replace(e.msg, left_out=[LeftOut(rollout_id="g00000-r1",
                                                                                   status="ok")]))
              if isinstance(e.msg, TreeGroup) and e.msg.group_id == "g00000" else e for e in events]
    assert broken(check_run(write_run(tmp_path / "run", events, rows, updates))) == {"rollouts": [
        ("1 rollout(s) counted with another status than they finished with: g00000-r1 (harness_error counted as "
        "ok)")]}


def test_a_step_trained_twice_missing_or_disagreeing_with_its_checkpoint(tmp_path):
    events, rows, updates = clean()
    again = Event(0.0, "learner.updates", PolicyUpdated(version=3, step=2, batch_hash="other", groups=["g00001"]))
    events = drop(events, lambda m: isinstance(m, PolicyUpdated) and m.step == 1)
    assert broken(check_run(write_run(tmp_path / "run", [*events, again], rows, updates))) == {"steps": [
        "step 1 was never announced as trained (checkpointed: True)",
        "step 2 was trained 2 times (batch hashes hash2, other)",
        "checkpoint step00002 trained batch hash2, the log announced other",
        "1 group slot(s) trained more than once: 1"]}


def test_a_run_that_stopped_early_or_trained_past_its_checkpoint(tmp_path):
    events, rows, updates = clean()
    report = check_run(write_run(tmp_path / "run", events, rows, updates[:1]))
    assert broken(report) == {"steps": ["the run stopped after step 1 of 2 (its last checkpoint)",
                                        "step(s) 2 announced as trained past the last checkpoint (step 1)"],
                              "rows": ["rows of step(s) 2 past the last checkpoint (step 1)"]}


def test_a_missing_or_different_row(tmp_path):
    events, rows, updates = clean()
    different = msgspec.structs.replace(rows[0], values={"reward": 0.25, "step": 1.0})
    report = check_run(write_run(tmp_path / "run", events, [different, rows[0]], updates))
    assert broken(report) == {"rows": ["1 step(s) without a row in metrics.jsonl: 2"]}
    assert report.notes == [("metrics.jsonl holds a step's row more than once for step(s) 1 (written again by a "
                            "resume; the later row counts)")]
    report = check_run(write_run(tmp_path / "run2", events, [rows[0], different], updates))
    assert broken(report) == {"rows": ["1 step(s) without a row in metrics.jsonl: 2",
                                       "metrics.jsonl rows of step(s) 1 differ from the log"]}


def test_a_step_without_its_metric_in_the_log(tmp_path):
    events, rows, updates = clean()
    events = drop(events, lambda m: isinstance(m, Metric) and m.step == 2)
    assert broken(check_run(write_run(tmp_path / "run", events, rows, updates))) == {
        "rows": ["1 step(s) without an rl_step Metric in the event log: 2"]}


def test_leftovers_outside_the_folder_and_processes_of_the_run(tmp_path):
    events, rows, updates = clean()
    run_dir = write_run(tmp_path / "run", events, rows, updates)
    tag = run_tag(run_dir)
    workspace = Path(tempfile.mkdtemp(prefix=f"{run_prefix(tag)}g00001-r0-"))
    sockets = Path(tempfile.mkdtemp(prefix=f"bridle.sock-{tag}_proxy_"))
    (run_dir / "checkpoints" / "step00003.tmp").mkdir()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        start = process_start(sleeper.pid)
        assert start is not None
        found = broken(check_run(run_dir, pids=[(sleeper.pid, start), (sleeper.pid, start + 1)]))
    finally:
        sleeper.kill()
        sleeper.wait()
        os.rmdir(workspace)
        os.rmdir(sockets)
    assert found == {"leftovers": [f"workspaces: {workspace}", f"socket_folders: {sockets}",
                                   f"processes: pid {sleeper.pid} (started by the run)",
                                   f"cut_checkpoints: {run_dir / 'checkpoints' / 'step00003.tmp'}"]}
    assert check_run(run_dir, pids=[(sleeper.pid, start)]).broken() == {
        "leftovers": [f"cut_checkpoints: {run_dir / 'checkpoints' / 'step00003.tmp'}"]}


def test_a_cut_or_missing_log(tmp_path):
    events, rows, updates = clean()
    run_dir = write_run(tmp_path / "run", events, rows, updates)
    with (run_dir / "events.msgpack").open("ab") as f:
        f.write(b"\x40\x00\x00\x00")  # the first bytes of a frame a kill cut
    assert list(broken(check_run(run_dir))) == ["log"]
    (run_dir / "events.msgpack").unlink()
    report = check_run(run_dir)
    assert [f.invariant for f in report.findings] == ["log"] and "no such event log" in report.findings[0].detail


@pytest.mark.parametrize("every", [1, 2])
def test_a_step_trained_again_after_a_kill_is_allowed_only_between_checkpoints(tmp_path, every):
    """Four steps, checkpoints after steps 2 and 4; killed after step 3 was announced, resumed from step 2: step 3
    trained again, under new group ids. With checkpoint_every = 2 that is the design; with 1, step 3's checkpoint
    came before its announcement, so training it again is a fault."""
    first = [step(s, f"g{s - 1:05d}") for s in (1, 2, 3)]
    again = [step(s, f"g{s - 1:05d}-a1") for s in (3, 4)]
    events = [e for evs, _, _ in [*first, *again] for e in evs]
    rows = [m for _, m, _ in [*first, *again]]
    config = {**CONFIG, "run": {"steps": 4}, "learner": {"checkpoint_every": every}}
    run_dir = write_run(tmp_path / "run", events, rows, [first[1][2], again[1][2]], config)
    found = broken(check_run(run_dir))
    if every == 2:
        assert found == {}
    else:
        assert found == {"steps": ["step 3 was trained 2 times (batch hashes hash3, hash3)",
                                   "1 group slot(s) trained more than once: 2"],
                         "rows": ["step(s) 3 have more than one rl_step Metric in the log"]}
