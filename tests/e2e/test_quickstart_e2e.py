"""The main job end to end, shortened: `run.py --experiment quickstart` as a user runs it, then replay.

Real parts throughout: the embedded engine in its own process, the proxy, the white-box harness as local
processes, the verifier, the collector, trees, SFT on demonstrations recorded through the pipeline, GRPO steps,
weight pushes, the monitor. Only the sizes are cut (a few demonstrations, two RL steps) to keep it to minutes.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import run_py as run

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow




def test_short_quickstart_then_replay_stages_reproduce_hashes(tmp_path):
    model = tmp_path / "model"
    run_dir = tmp_path / "run"
    sets = [
        f'run.model="{model}"', "experiment.build_model.tasks=60",
        "scheduler.sft_groups=16", "tree.sft_pack=8", "learner.sft_epochs=2",
        "run.steps=2", "scheduler.group_size=3", "run.groups_per_step=2", "scheduler.tasks.count=40",
        'monitor.display="off"', 'monitor.trackers=["tensorboard", "wandb"]',
    ]
    args = ["--experiment", "quickstart", "--run-dir", str(run_dir), "--no-watch"]
    for s in sets:
        args += ["--set", s]
    r = run(*args)
    assert r.returncode == 0, r.stderr[-4000:]
    for name in ("events.msgpack", "metrics.jsonl", "plots.png", "config.toml", "log.jsonl"):
        assert (run_dir / name).exists(), name
    assert list((run_dir / "checkpoints").glob("step*")), "no checkpoint"
    started = [e for e in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines())
               if e.get("event") == "run started"]
    assert [e["event_loop"] for e in started] == ["uvloop"]  # the proxy's loop is its throughput limit
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [m for m in metrics if m["kind"] == "rl_step"]
    assert [m["step"] for m in rl] == [1, 2]
    assert all(m["source"] == "learner.rl" for m in rl)  # metrics.jsonl keeps who sent it
    sft = [m for m in metrics if m["kind"] == "sft_update"]
    assert len(sft) == 2 * 2 and {m["sft_updates"] for m in sft} == {4}  # 2 packs x 2 epochs, announced
    # the trackers got what metrics.jsonl holds, each kind against its own step, and the resolved config
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.helpers.wandb_offline import offline_runs

    ea = EventAccumulator(str(run_dir / "tensorboard"))
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("rl_step/reward")] == [(m["step"], m["reward"]) for m in rl]
    assert [e.step for e in ea.Scalars("sft_update/loss")] == [1, 2, 3, 4]
    assert ea.Scalars("rollouts/ok")[-1].value >= 1
    (wb,) = offline_runs(run_dir)
    assert wb["config"]["run"]["steps"] == 2 and wb["config"]["learner"]["train"]["optimizer"]["lr"] == 5e-4
    assert [h["rl_step/reward"] for h in wb["history"] if "rl_step/reward" in h] == [m["reward"] for m in rl]
    # demonstrations come from their own task set ([scheduler].sft_tasks), training from the pool
    from pipeline.core.eventlog import EventLogReader
    from pipeline.messages import RolloutRequest

    reqs = [e.msg for e in EventLogReader(run_dir / "events.msgpack")
            if isinstance(e.msg, RolloutRequest) and e.src.startswith("scheduler")]
    folders = {p: {Path(r.task_path).parent for r in reqs if r.purpose == p} for p in ("sft", "train")}
    assert folders == {"sft": {run_dir / "sft_tasks"}, "train": {run_dir / "tasks"}}
    s = json.loads(run("--replay", str(run_dir / "events.msgpack"), "--json").stdout)
    assert s["by_type"]["PolicyUpdated"] == 3  # after SFT, after each of the 2 RL steps
    assert s["by_type"]["RolloutFinished"] == 16 + 2 * 2 * 3
    assert s["truncated_at"] is None

    # per-rollout tree statistics, rebuilt from the log
    out = run("--replay", str(run_dir / "events.msgpack"), "--trees").stdout
    lines = [ln for ln in out.splitlines() if ln.startswith(("sft", "g0"))]
    assert len(lines) == 16 + 2 * 2 * 3
    assert all("exact-attach=100.0%" in ln for ln in lines)  # the white-box harness never rewrites history (C0)
    assert "harness whitebox: rollouts=28" in out and "NOT JOINED" not in out

    # the same log gives the same trees and the same training batches
    r = run("--replay", str(run_dir / "events.msgpack"), "--stage", "trees", "--run-dir", str(tmp_path / "rt"))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["trees"]["replayed"] == out["trees"]["recorded"] == out["trees"]["identical"] > 0
    r = run("--replay", str(run_dir / "events.msgpack"), "--stage", "learner", "--run-dir", str(tmp_path / "rl"))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["batches"]["replayed"] == out["batches"]["recorded"] == out["batches"]["identical"] == 3


def test_kill_9_then_resume_keeps_the_policy_and_neither_repeats_nor_skips_a_step(tmp_path):
    """kill -9 after step 2 of 5 (with a cold start, so the KL reference is the SFT policy, not the base), resume:
    every step trained once, in order; KL and entropy continue where they were (before references were saved
    with checkpoints, the resumed KL term pulled towards the random base: KL 0.006 -> 5.85); re-issued groups
    carry new ids; the watcher does not log the run directory's churn; nothing of the run is left on the host
    (workspaces, socket folders, harness processes, containers)."""
    import os
    import signal
    import tempfile
    import time

    from pipeline.core.eventlog import EventLogReader
    from pipeline.core.runfiles import run_tag
    from pipeline.messages import PolicyUpdated, RolloutFinished, RolloutRequest
    from pipeline.rollout.sandbox.local import MARKER_RUN
    from pipeline.rollout.sandbox.util import run_prefix
    from tests.helpers.leftovers import leftovers_of

    model = tmp_path / "model"
    run_dir = tmp_path / "run"
    sets = [
        f'run.model="{model}"', "experiment.build_model.tasks=60",
        "scheduler.sft_groups=32", "tree.sft_pack=8", "learner.sft_epochs=5", "run.steps=5",
        "scheduler.group_size=3", "run.groups_per_step=2",
        "scheduler.tasks.count=20", "monitor.display=\"off\"", "learner.checkpoint_every=1",
    ]
    proc = start_quickstart(run_dir, sets)
    try:
        t0 = time.monotonic()
        while not (run_dir / "checkpoints" / "step00002" / "learner_state.json").exists():
            assert proc.poll() is None, "the run ended before its second checkpoint"
            assert time.monotonic() - t0 < 600, "no second checkpoint within 10 minutes"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # run.py; the engine notices its parent died; harnesses live on
        proc.wait()
    # The kill may come between a step's checkpoint and its announcement (it did in 1 of 2 tries): make it so, by
    # taking the last checkpointed step's update record and metrics row out of what the killed run wrote. The
    # resume must write them.
    last = max(run_dir.glob("checkpoints/step*/learner_state.json"))  # step 2, or 3 if the kill came late
    k = int(last.parent.name.removeprefix("step"))
    saved = json.loads(last.read_text())["extra"]["announce"]
    forget_step(run_dir, k)
    # What a crash leaves, for certain (the kill may have caught no rollout in flight): a harness that outlived
    # bridle, a workspace and a proxy-socket folder of this run. The resume must remove them, and its own.
    tag = run_tag(run_dir)
    survivor = subprocess.Popen(["sleep", "600"], env={"PATH": os.defpath, MARKER_RUN: tag}, start_new_session=True)
    planted = [Path(tempfile.mkdtemp(prefix=f"{run_prefix(tag)}g99999-r0-")),
               Path(tempfile.mkdtemp(prefix=f"bridle.sock-{tag}_proxy_"))]
    # the /proc scan may run before the new process is listed with its environment: look again for up to 5 s
    for _ in range(50):
        if {"workspaces", "proxy_sockets", "processes"} <= set(leftovers_of(run_dir)):
            break
        time.sleep(0.1)
    assert {"workspaces", "proxy_sockets", "processes"} <= set(leftovers_of(run_dir)), (
        f"planted survivor pid {survivor.pid}: exit status {survivor.poll()}")
    # A fresh start in the killed run's folder is refused, touching nothing (it would mix two runs' records); the
    # message says how to continue the run instead.
    before = (run_dir / "events.msgpack").read_bytes()
    fresh = run("--experiment", "quickstart", "--run-dir", str(run_dir), "--no-watch",
                *[x for kv in sets for x in ("--set", kv)])
    assert fresh.returncode == 2 and f"--resume {run_dir}" in fresh.stderr, fresh.stderr[-2000:]
    assert (run_dir / "events.msgpack").read_bytes() == before
    try:
        r = run("--resume", str(run_dir))  # watching its config.toml, which lives in the busy run directory
        killed = survivor.poll()
    finally:
        survivor.kill()
        survivor.wait()
    assert r.returncode == 0, r.stderr[-4000:]
    assert killed == -signal.SIGKILL  # by the resumed run's sandbox backend
    assert not any(p.exists() for p in planted)
    assert leftovers_of(run_dir) == {}
    assert "changes detected" not in r.stderr + r.stdout
    events = list(EventLogReader(run_dir / "events.msgpack"))
    steps = [(e.msg.step, e.msg.batch_hash) for e in events if isinstance(e.msg, PolicyUpdated)]
    assert (k, saved["batch_hash"]) in steps, steps  # written at the resume, as trained when it was
    trained = [s for s, h in steps if h]
    assert len(trained) == len(set(trained)), f"a step was trained twice: {steps}"
    assert sorted({s for s, _ in steps}) == [0, 1, 2, 3, 4, 5], f"a step is missing: {steps}"
    assert [s for s, _ in steps] == sorted(s for s, _ in steps)
    finished: dict[str, int] = {}
    for e in events:
        if isinstance(e.msg, RolloutFinished):
            finished[e.msg.rollout_id] = finished.get(e.msg.rollout_id, 0) + 1
    assert max(finished.values()) == 1, "a rollout id finished twice"
    reissued = {e.msg.group_id for e in events if isinstance(e.msg, RolloutRequest) and e.src.startswith("scheduler")}
    assert any(g.endswith("-a1") for g in reissued)

    rl = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if m["source"] == "learner.rl":
            rl[m["step"]] = m  # the resumed run's records of a step replace those of the killed one
    assert sorted(rl) == [1, 2, 3, 4, 5], sorted(rl)  # every row, step k's written by the resume
    assert rl[k].get("reward") == saved["metrics"].get("reward")
    # a step whose groups all had one reward trains nothing and measures no KL, entropy or reward: left out
    before = [rl[s] for s in (1, 2) if "kl" in rl.get(s, {})]
    after = [rl[s] for s in (3, 4, 5) if "kl" in rl.get(s, {})]
    assert before and after, rl
    kl_scale = max(m["kl"] for m in before)
    assert after[0]["kl"] <= 2 * kl_scale + 0.02, (before, after)
    assert abs(after[0]["entropy"] - before[-1]["entropy"]) < 0.3, (before, after)
    # The reward curve continues: the resumed steps' mean reward is within two standard errors of the steps before
    # the kill (6 rollouts a step, rewards in [0, 1], so SE <= 0.5 * sqrt(1/12 + 1/18)). Coarse at this size (the
    # sharp detector of a lost policy is the KL above); a policy reset to the random base scores 0.
    r_before = sum(m["reward"] for m in before) / len(before)
    r_after = sum(m["reward"] for m in after) / len(after)
    assert r_after >= r_before - 2 * 0.5 * (1 / 12 + 1 / 18) ** 0.5, (before, after)


def test_a_run_killed_during_its_cold_start_resumes_by_starting_over(tmp_path):
    """kill -9 during SFT (no checkpoint yet): --resume starts the run over in its folder, sets aside what the
    killed start wrote, and leaves nothing of either start behind."""
    import os
    import signal
    import time

    from tests.helpers.leftovers import leftovers_of

    run_dir = tmp_path / "run"
    sets = [f'run.model="{tmp_path / "model"}"', "experiment.build_model.tasks=60", "scheduler.sft_groups=16",
            "tree.sft_pack=8", "learner.sft_epochs=30", "run.steps=1", "scheduler.group_size=2",
            "run.groups_per_step=1", "scheduler.tasks.count=4", 'monitor.display="off"']
    proc = start_quickstart(run_dir, sets)
    try:
        t0 = time.monotonic()
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and '"sft_update"' in metrics.read_text()):
            assert proc.poll() is None, "the run ended before its cold start"
            assert time.monotonic() - t0 < 600, "no SFT update within 10 minutes"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not list(run_dir.glob("checkpoints/step*"))
    sets[4] = "learner.sft_epochs=1"  # the second start need not be long
    resumed = ["--resume", str(run_dir)]
    for s in sets:
        resumed += ["--set", s]
    r = run(*resumed)
    assert r.returncode == 0, r.stderr[-4000:]
    (aside,) = (run_dir / "killed-starts").iterdir()
    assert (aside / "events.msgpack").is_file()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows if m["kind"] == "rl_step"] == [1]
    assert leftovers_of(run_dir) == {}


def test_a_run_killed_after_a_cold_start_checkpoint_resumes_the_cold_start(tmp_path):
    """kill -9 during SFT after a cold-start checkpoint: --resume continues the same SFT plan from that checkpoint
    with the recorded demonstrations (none is played again), publishes the SFT weights once, trains its RL step, and
    removes the cold-start checkpoint once the RL step's is written."""
    import os
    import signal
    import time

    from pipeline.core.eventlog import EventLogReader
    from pipeline.messages import PolicyUpdated, RolloutRequest
    from tests.helpers.leftovers import leftovers_of

    run_dir = tmp_path / "run"
    sets = [f'run.model="{tmp_path / "model"}"', "experiment.build_model.tasks=60", "scheduler.sft_groups=16",
            "tree.sft_pack=8", "learner.sft_epochs=40", "learner.sft_checkpoint_every=8", "run.steps=1",
            "scheduler.group_size=2", "run.groups_per_step=1", "scheduler.tasks.count=4", 'monitor.display="off"']
    proc = start_quickstart(run_dir, sets)
    try:
        t0 = time.monotonic()
        while not list(run_dir.glob("checkpoints/sft[0-9]*[0-9]")):
            assert proc.poll() is None, "the run ended before its first cold-start checkpoint"
            assert time.monotonic() - t0 < 600, "no cold-start checkpoint within 10 minutes"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    (ckpt,) = [c for c in run_dir.glob("checkpoints/sft*") if not c.name.endswith(".tmp")]
    held = int(ckpt.name.removeprefix("sft"))
    assert held % 8 == 0 and held < 80  # 2 packs x 40 epochs = 80 updates
    resumed = ["--resume", str(run_dir)]
    for s in sets:
        resumed += ["--set", s]
    r = run(*resumed)
    assert r.returncode == 0, r.stderr[-4000:]
    assert not (run_dir / "killed-starts").exists()  # continued, not started over
    lines = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    (note,) = [x for x in lines if x.get("event") == "resumed in the cold start"]
    assert note["sft_updates_done"] == held and note["packs"] == 2
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    done = {int(m["sft_update"]) for m in rows if m["kind"] == "sft_update"}
    assert done == set(range(1, 81))  # every update of the plan ran; those after the checkpoint possibly twice
    assert [m["step"] for m in rows if m["kind"] == "rl_step"] == [1]
    events = list(EventLogReader(run_dir / "events.msgpack"))
    sent = [e.msg for e in events if isinstance(e.msg, RolloutRequest) and e.src.startswith("scheduler")]
    assert sum(m.purpose == "sft" for m in sent) == 16  # played once
    assert [e.msg.step for e in events if isinstance(e.msg, PolicyUpdated)] == [0, 1]
    assert not list(run_dir.glob("checkpoints/sft*")) and list(run_dir.glob("checkpoints/step00001"))
    assert leftovers_of(run_dir) == {}


def forget_step(run_dir: Path, step: int) -> None:
    """The run folder as a kill between RL step ``step``'s checkpoint and its announcement leaves it: the event log
    and metrics.jsonl without the step's update record and metrics row (the log is rewritten frame by frame)."""
    from pipeline.core.eventlog import EventLogReader, EventLogWriter
    from pipeline.messages import Metric, PolicyUpdated

    src = run_dir / "events.msgpack"
    reader = EventLogReader(src)
    keep = [ev for ev in reader
            if not (isinstance(ev.msg, (PolicyUpdated, Metric)) and ev.msg.step >= step
                    and (isinstance(ev.msg, PolicyUpdated) or ev.msg.kind == "rl_step"))]
    tmp = run_dir / "events.rewritten"
    with EventLogWriter(tmp, reader.header) as w:
        for ev in keep:
            w.append(ev.src, ev.msg, t=ev.t)
    tmp.replace(src)
    rows = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if not (json.loads(line)["kind"] == "rl_step" and json.loads(line)["step"] >= step)]
    (run_dir / "metrics.jsonl").write_text("".join(f"{line}\n" for line in rows))


def start_quickstart(run_dir: Path, sets: list[str]) -> subprocess.Popen:
    """``run.py --experiment quickstart`` with ``sets``, in a session of its own (to be killed with its group)."""
    args = [sys.executable, "run.py", "--experiment", "quickstart", "--run-dir", str(run_dir), "--no-watch"]
    for s in sets:
        args += ["--set", s]
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
