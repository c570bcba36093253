"""The quickstart with two learner ranks (``[learner] processes = 2``, DDP over gloo on the CPU), shortened: it runs
end to end, its learner replays to the same batches, and a ``kill -9`` mid-run resumes with two ranks, neither
repeating nor skipping a step. Real parts throughout, as in test_quickstart_e2e.py."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.cli import run_py as run

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow




def _args(run_dir: Path, sets: list[str]) -> list[str]:
    args = ["--experiment", "quickstart", "--run-dir", str(run_dir), "--no-watch"]
    for s in sets:
        args += ["--set", s]
    return args


def _sets(model: Path, steps: int) -> list[str]:
    return [
        f'run.model="{model}"', "experiment.build_model.tasks=60", "learner.processes=2",
        "scheduler.sft_groups=16", "tree.sft_pack=8", "learner.sft_epochs=2", "learner.sft_batch_groups=2",
        f"run.steps={steps}", "scheduler.group_size=3", "run.groups_per_step=2", "scheduler.tasks.count=40",
        'monitor.display="off"', "learner.checkpoint_every=1",
    ]


def _no_ranks_left(run_dir: Path) -> None:
    """No rank of this run still running (their command line names the run's socket folder), no socket folder."""
    from pipeline.core.runfiles import run_tag
    from tests.helpers.leftovers import leftovers_of

    mark = f"bridle.sock-{run_tag(run_dir)}_"
    out = subprocess.run(["pgrep", "-f", "pipeline.training.rank_worker"], capture_output=True, text=True,
                         check=False).stdout
    mine = []
    for pid in out.split():
        try:
            if mark in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                mine.append(pid)
        except OSError:
            pass  # ended meanwhile
    assert not mine, f"learner ranks left running: {mine}"
    assert leftovers_of(run_dir) == {}


def test_quickstart_with_two_learner_ranks_then_replay(tmp_path):
    model, run_dir = tmp_path / "model", tmp_path / "run"
    r = run(*_args(run_dir, _sets(model, steps=2)))
    assert r.returncode == 0, r.stderr[-4000:]
    log = (run_dir / "learner_ranks.log").read_text()
    assert "rank=0" in log and "rank=1" in log and "ranks=2" in log  # two ranks of one process group trained
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["kind"] == "rl_step"] == [1, 2]
    sft = [m for m in metrics if m["kind"] == "sft_update"]
    assert len(sft) == 2 and all(m["trainable_tokens"] > 0 for m in sft)  # 2 packs x 2 epochs / 2 per update
    assert list((run_dir / "checkpoints").glob("step00002"))
    # the same log gives the same training batches, through two ranks again
    r = run("--replay", str(run_dir / "events.msgpack"), "--stage", "learner", "--run-dir", str(tmp_path / "rl"))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["batches"]["replayed"] == out["batches"]["recorded"] == out["batches"]["identical"] == 3
    assert (tmp_path / "rl" / "learner_ranks.log").exists()
    _no_ranks_left(run_dir)


def test_kill_9_then_resume_with_two_learner_ranks(tmp_path):
    from pipeline.core.eventlog import EventLogReader
    from pipeline.messages import PolicyUpdated

    model, run_dir = tmp_path / "model", tmp_path / "run"
    err = tmp_path / "first.stderr"
    with open(err, "wb") as errf:
        proc = subprocess.Popen([sys.executable, "run.py", *_args(run_dir, _sets(model, steps=4))], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=errf, start_new_session=True)
    try:
        t0 = time.monotonic()
        while not (run_dir / "checkpoints" / "step00002" / "learner_state.json").exists():
            assert proc.poll() is None, f"the run ended before its second checkpoint:\n{err.read_text()[-4000:]}"
            assert time.monotonic() - t0 < 600, "no second checkpoint within 10 minutes"
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # run.py; the ranks see their channel close and exit
        proc.wait()
    ckpt = run_dir / "checkpoints" / "step00002"
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= {p.name for p in ckpt.iterdir()}  # both ranks' RNG
    r = run("--resume", str(run_dir))
    assert r.returncode == 0, r.stderr[-4000:]
    events = list(EventLogReader(run_dir / "events.msgpack"))
    steps = [(e.msg.step, e.msg.batch_hash) for e in events if isinstance(e.msg, PolicyUpdated)]
    trained = [s for s, h in steps if h]
    assert len(trained) == len(set(trained)), f"a step was trained twice: {steps}"
    assert sorted({s for s, _ in steps}) == [0, 1, 2, 3, 4], f"a step is missing: {steps}"
    rl = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if m["source"] == "learner.rl":
            rl[m["step"]] = m
    # the resumed ranks continue from the checkpoint's policy: the KL to the SFT reference stays where it was (a
    # step whose groups all had one reward trained nothing and measured no KL)
    before = [rl[s]["kl"] for s in (1, 2) if "kl" in rl[s]]
    after = [rl[s]["kl"] for s in (3, 4) if "kl" in rl[s]]
    assert all(k <= 2 * max(before, default=0.0) + 0.02 for k in after), rl
    # the resumed learner names the run's one KL reference again instead of writing a copy
    assert len(list((run_dir / "checkpoints").glob("reference-v*"))) == 1
    _no_ranks_left(run_dir)
