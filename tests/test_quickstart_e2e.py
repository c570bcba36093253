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

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def run(*args, timeout=900):
    return subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_short_quickstart_then_replay_stages_reproduce_hashes(tmp_path):
    model = tmp_path / "model"
    run_dir = tmp_path / "run"
    sets = [
        f'experiment.build_model.path="{model}"', "experiment.build_model.tasks=60",
        f'proxy.engine.model="{model}"', f'learner.model="{model}"',
        "scheduler.sft_groups=16", "tree.sft_pack=8", "learner.sft_packs=2", "learner.sft_epochs=2",
        "scheduler.steps=2", "learner.steps=2", "scheduler.group_size=3", "scheduler.groups_per_step=2",
        "learner.groups_per_step=2", "scheduler.tasks.count=40", "monitor.display=\"off\"",
    ]
    args = ["--experiment", "quickstart", "--run-dir", str(run_dir), "--no-watch"]
    for s in sets:
        args += ["--set", s]
    r = run(*args)
    assert r.returncode == 0, r.stderr[-4000:]
    for name in ("events.msgpack", "metrics.jsonl", "plots.png", "config.toml", "log.jsonl"):
        assert (run_dir / name).exists(), name
    assert list((run_dir / "checkpoints").glob("step*")), "no checkpoint"
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [m for m in metrics if m["source"] == "learner.rl"]
    assert [m["step"] for m in rl] == [1, 2]
    s = json.loads(run("--replay", str(run_dir / "events.msgpack"), "--json").stdout)
    assert s["by_type"]["PolicyUpdated"] == 3  # after SFT, after each of the 2 RL steps
    assert s["by_type"]["RolloutFinished"] == 16 + 2 * 2 * 3
    assert s["truncated_at"] is None

    # the same log gives the same trees and the same training batches
    r = run("--replay", str(run_dir / "events.msgpack"), "--stage", "trees", "--run-dir", str(tmp_path / "rt"))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["trees"]["replayed"] == out["trees"]["recorded"] == out["trees"]["identical"] > 0
    r = run("--replay", str(run_dir / "events.msgpack"), "--stage", "learner", "--run-dir", str(tmp_path / "rl"))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["batches"]["replayed"] == out["batches"]["recorded"] == out["batches"]["identical"] == 3
