"""The quickstart, shortened, with ``[learner].weight_sync = "distributed"``: after the cold start (whose weights
are written: RL starts from that folder), every update goes to the embedded engine by gloo broadcast and nothing
is written to the weights folder; the engine samples the next rollouts with the pushed version; checkpoints are
still written; a replay of the learner (whose recorded engine is gone) falls back to the disk and reproduces the
batches."""

import json
from pathlib import Path

import pytest

from pipeline.core.eventlog import EventLogReader
from pipeline.messages import ModelCall, PolicyUpdated
from tests.helpers.cli import run_py as run

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow




def test_quickstart_with_distributed_weight_sync(tmp_path):
    model, run_dir = tmp_path / "model", tmp_path / "run"
    sets = [
        f'run.model="{model}"', "experiment.build_model.tasks=60", 'learner.weight_sync="distributed"',
        "scheduler.sft_groups=8", "tree.sft_pack=8", "learner.sft_epochs=1",
        "run.steps=2", "scheduler.group_size=3", "run.groups_per_step=1", "scheduler.tasks.count=20",
        "run.max_staleness=0",  # step 2's group waits for step 1's weights
        'monitor.display="off"',
    ]
    args = ["--experiment", "quickstart", "--run-dir", str(run_dir), "--no-watch"]
    for s in sets:
        args += ["--set", s]
    r = run(*args)
    assert r.returncode == 0, r.stderr[-4000:]
    events = list(EventLogReader(run_dir / "events.msgpack"))
    updates = [e.msg for e in events if isinstance(e.msg, PolicyUpdated)]
    assert [(u.step, bool(u.weights_path), u.pushed) for u in updates] == [(0, True, False), (1, False, True),
                                                                            (2, False, True)]
    # written: the cold start's folder and, once the run is done, the final policy (for --eval --checkpoint);
    # checkpoints go to disk as before
    assert sorted(p.name for p in (run_dir / "weights").glob("v*")) == [Path(updates[0].weights_path).name,
                                                                        f"v{updates[-1].version:05d}"]
    assert (run_dir / "weights" / f"v{updates[-1].version:05d}" / "config.json").is_file()
    assert list((run_dir / "checkpoints").glob("step*"))
    # the rollouts of step 2 (issued once step 1 was pushed: max_staleness 0) were sampled by the pushed version
    pushed = updates[1].version
    versions = {s.version for e in events if isinstance(e.msg, ModelCall) for s in e.msg.versions}
    assert pushed in versions
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    syncs = [m for m in metrics if m["kind"] == "weight_sync" and m["source"] == "learner"]
    assert [m["policy_version"] for m in syncs] == [u.version for u in updates[1:]]
    log = (run_dir / "log.jsonl").read_text()
    assert "weight update group could not be set up" not in log and "update over the weight update group failed" \
        not in log

    # the replayed learner's engine is gone: it says so and writes the weights instead; the batches are the same
    r = run("--replay", str(run_dir / "events.msgpack"), "--stage", "learner", "--run-dir", str(tmp_path / "rl"))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["batches"]["replayed"] == out["batches"]["recorded"] == out["batches"]["identical"] == 3
    assert "weight update group could not be set up" in (tmp_path / "rl" / "log.jsonl").read_text()
