"""configs/mix-cpu.toml end to end: the whole loop through all four black-box harnesses and the white-box one.

Docker sandboxes on network "none", the embedded engine with a tiny full-vocabulary Qwen3-shaped policy, one
group per (task, harness) pair. Cold start: an oracle demonstration through each harness (the scripted engine
behind the real proxy), one SFT pack each, the weights pushed to the engine; then a GRPO step sampling through every
harness from them (the shipped config runs two; one keeps CI short, and pushing after an RL step is the quickstart
tests'). Then the log is replayed: the learner's batches and every rollout's tree. About 4 minutes on 2 busy cores. Fails in CI (CI=true) when Docker, an image or a harness is missing.
"""

import json
from pathlib import Path

import pytest

from tests.helpers.cli import run_py, run_py_together
from tests.helpers.docker import require_images

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.harness, pytest.mark.timeout(1500)]
HARNESSES = ["openclaw", "qwen-code", "claude-code", "codex", "whitebox:S0T0O0C0W0"]


def run(*args: str):
    return run_py(*args, timeout=1500)


def test_mix_cpu_every_harness_through_demonstrations_sft_and_rl_then_replay(tmp_path):
    require_images()

    run_dir = tmp_path / "run"
    r = run("--experiment", "mix-cpu", "--run-dir", str(run_dir), "--no-watch",
            "--set", f'run.model="{tmp_path / "model"}"', "--set", 'monitor.display="off"', "--set", "run.steps=1")
    assert r.returncode == 0, r.stderr[-4000:]
    log = run_dir / "events.msgpack"

    from pipeline.cli.harness_report import report
    from pipeline.core.eventlog import EventLogReader
    from pipeline.messages import ModelCall, PolicyUpdated, RolloutFinished, RolloutRequest

    stats = {s.harness: s for s in report(log)}
    assert sorted(stats) == sorted(HARNESSES)
    for s in stats.values():
        # 1 demonstration + 1 step x 1 group x 2 rollouts, every one settled and turned into a tree
        assert (s.rollouts, s.demonstrations, s.settled) == (3, 1, 3), s
        assert s.sft_packs == 1, s  # its own demonstration pack, trained in the cold start
        assert s.groups_trained == 1, s  # the RL step trained on its group (PolicyUpdated.groups)
        assert s.calls >= 5 and s.max_input_tokens > 0, s

    events = list(EventLogReader(log))
    requests = {e.msg.rollout_id: e.msg for e in events if isinstance(e.msg, RolloutRequest)}
    demos = [e.msg for e in events if isinstance(e.msg, RolloutFinished)
             and requests[e.msg.rollout_id].purpose == "sft"]
    assert sorted(requests[f.rollout_id].harness for f in demos) == sorted(HARNESSES)
    assert all((f.status, f.reward) == ("ok", 1.0) for f in demos), [(f.rollout_id, f.details) for f in demos]

    updates = [e.msg for e in events if isinstance(e.msg, PolicyUpdated)]
    assert [u.step for u in updates] == [0, 1]  # after SFT, after the RL step
    assert len(updates[0].groups) == 5 and all(u.groups for u in updates)  # the packs, then each step's groups
    assert all(u.weights_path and u.batch_hash for u in updates) and Path(updates[-1].weights_path).is_dir()
    sft_version = updates[0].version
    pushed = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    pushed = {int(x["version"]) for x in pushed if x.get("event") == "engine weights updated"}
    assert sft_version in pushed  # the last one is published as the run ends
    for h in HARNESSES:  # every harness sampled from the pushed weights, not the initial ones
        versions = [int(c.versions[0].version) for e in events if isinstance(c := e.msg, ModelCall)
                    and requests[c.rollout_id].harness == h and requests[c.rollout_id].purpose == "train"]
        assert versions and min(versions) >= sft_version, (h, versions)

    # the replays and the evaluation read the run and write elsewhere: side by side
    summary, trees, learner, r = run_py_together(
        ["--replay", str(log)],
        ["--replay", str(log), "--trees"],
        ["--replay", str(log), "--stage", "learner", "--run-dir", str(tmp_path / "rl")],
        # the trained policy evaluated through every harness on held-out tasks: in-space and out-of-space columns
        ["--eval", "--experiment", "mix-cpu", "--checkpoint", str(run_dir), "--run-dir", str(tmp_path / "ev"),
         "--set", 'monitor.display="off"', "--set", "eval.tasks.count=1", "--set", "eval.samples=1",
         "--set", "eval.ks=[1]"], timeout=1500)
    assert summary.returncode == 0 and all(h in summary.stdout for h in HARNESSES), summary.stdout[-3000:]

    assert trees.returncode == 0, trees.stderr[-3000:]
    assert "NOT JOINED" not in trees.stdout
    assert all(f"harness {h.split(':')[0]}: rollouts=3" in trees.stdout for h in HARNESSES), trees.stdout[-3000:]

    assert learner.returncode == 0, learner.stderr[-3000:]
    out = json.loads(learner.stdout.strip().splitlines()[-1])
    assert out["batches"]["replayed"] == out["batches"]["recorded"] == out["batches"]["identical"] == 2

    assert r.returncode == 0, r.stderr[-3000:]
    columns = {ln.split("|")[2].strip() for ln in r.stdout.splitlines() if ln.startswith("| column |")}
    assert columns == {"in-space", "out-of-space"}, r.stdout
    rep = json.loads((tmp_path / "ev" / "eval" / "report.json").read_text())
    assert {row["key"] for row in rep["rows"] if row["scope"] == "harness"} == set(HARNESSES)
