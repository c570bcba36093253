"""Evaluation end to end: the quickstart's SFT policy against its random initial model on the same held-out tasks,
and periodic evaluation of held-out harness configurations during a short harness-scaling run."""

import json
from pathlib import Path

import pytest

from tests.helpers.cli import run_py as run
from tests.helpers.cli import run_py_together

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow




def sets(*pairs: str) -> list[str]:
    return [a for p in pairs for a in ("--set", p)]


def held_out_count(evaluated: Path, *training: Path) -> int:
    from pipeline.eval.plan import held_out
    from pipeline.rollout.tasks import load_task_dir

    return len(held_out(load_task_dir(evaluated), [t for d in training if d.is_dir() for t in load_task_dir(d)])[0])


def test_sft_policy_beats_the_random_init_on_held_out_tasks(tmp_path):
    model = tmp_path / "model"
    common = sets(f'run.model="{model}"', 'monitor.display="off"')
    # the cold start alone, as the quickstart has it: 128 demonstrations, 10 SFT epochs, then no RL step
    r = run("--experiment", "quickstart", "--run-dir", str(tmp_path / "sft"), "--no-watch", *common,
            *sets("run.steps=0"))
    assert r.returncode == 0, r.stderr[-3000:]
    ev = sets("eval.tasks.count=12", "eval.samples=2")
    # both evaluations read the model and write their own folders: side by side
    a, b = run_py_together(
        ["--eval", "--experiment", "quickstart", "--checkpoint", str(tmp_path / "sft"),
         "--run-dir", str(tmp_path / "eval-sft"), *common, *ev],
        ["--eval", "--experiment", "quickstart", "--model", str(model), "--run-dir", str(tmp_path / "eval-base"),
         *common, *ev])
    assert a.returncode == 0, a.stderr[-3000:]
    assert "| overall | all |" in a.stdout and "held-out" not in a.stdout.split("| overall")[0]
    assert b.returncode == 0, b.stderr[-3000:]

    rep = json.loads((tmp_path / "eval-sft" / "eval" / "report.json").read_text())
    overall = next(r for r in rep["rows"] if r["scope"] == "overall")
    kept = held_out_count(tmp_path / "eval-sft" / "eval_tasks", tmp_path / "sft" / "tasks", tmp_path / "sft" / "sft_tasks")
    assert kept >= 6  # create_word's space is small: some of the 12 equal a training task and are dropped
    assert overall["pairs"] == kept and overall["rollouts"] + overall["excluded"] == 2 * kept
    assert rep["policy"].startswith(str(tmp_path / "sft" / "weights"))
    # held out: none of the evaluated tasks is a training or demonstration task of the SFT run
    evaluated = {p["task_id"] for p in rep["pairs"]}
    assert evaluated  # held out by content (ids may coincide across seeds):
    from pipeline.eval.plan import content_hash
    from pipeline.rollout.tasks import load_task_dir

    seen = {content_hash(t) for t in load_task_dir(tmp_path / "sft" / "sft_tasks")}
    seen |= {content_hash(t) for t in load_task_dir(tmp_path / "sft" / "tasks")}
    assert not seen & {content_hash(t) for t in load_task_dir(tmp_path / "eval-sft" / "eval_tasks")
                       if t.id in evaluated}

    c = run("--compare", str(tmp_path / "eval-sft"), str(tmp_path / "eval-base"))
    assert c.returncode == 0, c.stderr
    print(c.stdout)
    line = next(ln for ln in c.stdout.splitlines() if ln.startswith("| pass@1 "))
    diff = line.split("|")[4].strip()
    mean = float(diff.split()[0])
    # the demonstrations taught the task (the quickstart's SFT policy scores ~0.2-0.3 on its distribution); the
    # random init never completes one
    assert mean > 0, c.stdout
    assert "[" in diff  # an interval, from 12 pairs

    # the behavioural metrics were measured from the recorded traces
    beh = json.loads((tmp_path / "eval-sft" / "eval" / "behaviour.json").read_text())
    assert beh["calls"] > 0 and beh["format_robustness"]["n"] == beh["calls"]

    # the same numbers again from the event log alone
    rp = run("--replay", str(tmp_path / "eval-sft" / "events.msgpack"), "--eval", "--json")
    assert rp.returncode == 0, rp.stderr[-2000:]
    again = json.loads(rp.stdout)["rounds"]
    assert len(again) == 1 and again[0]["step"] == -1
    assert again[0]["report"]["rows"] == rep["rows"]
    assert again[0]["by_harness"]["whitebox:S0T0O0C0W0"]["calls"] == beh["calls"]


def test_scaling_run_evaluates_held_out_configurations_periodically(tmp_path):
    r = run("--experiment", "scaling", "--run-dir", str(tmp_path / "run"), "--no-watch", *sets(
        f'run.model="{tmp_path / "model"}"', 'monitor.display="off"', "experiment.build_model.tasks=40",
        "run.steps=2", "run.groups_per_step=2", "scheduler.group_size=2", "scheduler.sft_groups=16",
        "tree.sft_pack=8", "learner.sft_epochs=2", "eval.every_steps=1", "eval.tasks.count=4",
        "eval.configs_per_column=2", "eval.samples=2"))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in rows if m["kind"] == "eval"]
    assert [m["step"] for m in evals] == [0, 1, 2]  # after the cold start and after each RL step
    kept = held_out_count(tmp_path / "run" / "eval_tasks", tmp_path / "run" / "tasks", tmp_path / "run" / "sft_tasks")
    assert kept >= 1
    for m in evals:
        assert m["in-space/pairs"] == kept * 2 and m["held-out/pairs"] == kept * 2
        assert 0.0 <= m["held-out/pass@1"] <= 1.0
    assert (tmp_path / "run" / "eval" / "step00002" / "report.md").is_file()
    assert (tmp_path / "run" / "eval.png").is_file()
    # evaluation rollouts were never trained: every trained group is a training group
    from pipeline.core.eventlog import EventLogReader
    from pipeline.messages import TreeGroup

    groups = [e.msg for e in EventLogReader(tmp_path / "run" / "events.msgpack") if isinstance(e.msg, TreeGroup)]
    assert groups and all(g.purpose != "eval" for g in groups)
    # behaviour for training and evaluation rollouts alike, per harness, from the log
    rp = run("--replay", str(tmp_path / "run" / "events.msgpack"), "--eval", "--json")
    out = json.loads(rp.stdout)
    assert [r["step"] for r in out["rounds"]] == [0, 1, 2]
    assert out["training"] and all(b["calls"] > 0 for b in out["training"].values())
    assert all(h.startswith("whitebox:") for h in out["training"])


def test_standalone_eval_of_the_published_sets_prints_in_space_and_held_out(tmp_path):
    r = run("--eval", "--experiment", "scaling", "--run-dir", str(tmp_path / "ev"), *sets(
        f'run.model="{tmp_path / "model"}"', 'monitor.display="off"', "experiment.build_model.tasks=40",
        "eval.tasks.count=3", "eval.configs_per_column=2", "eval.samples=1", "eval.ks=[1]"))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {ln.split("|")[2].strip(): ln for ln in r.stdout.splitlines() if ln.startswith("| column |")}
    assert set(rows) == {"in-space", "held-out"}, r.stdout
    rep = json.loads((tmp_path / "ev" / "eval" / "report.json").read_text())
    harnesses = {row["key"] for row in rep["rows"] if row["scope"] == "harness"}
    from pipeline.rollout.harness_space import PUBLISHED_HELD_OUT, PUBLISHED_TRAINING

    names = {h.removeprefix("whitebox:") for h in harnesses}
    assert len(names & set(PUBLISHED_TRAINING)) == 2 and len(names & set(PUBLISHED_HELD_OUT)) == 2
