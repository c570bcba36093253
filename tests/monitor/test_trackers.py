"""TensorBoard and W&B trackers: what they receive from metrics.jsonl rows, read back from the files they wrote
(TensorBoard's event files; W&B's offline log, as `wandb sync` would upload it)."""

import importlib.util
from pathlib import Path

import pytest

from pipeline.monitor.trackers import Trackers, scalars, tracker_problem
from tests.helpers.wandb_offline import offline_runs

CONFIG = {"run": {"steps": 2}, "learner": {"train": {"optimizer": {"lr": 5e-4}}}}
ROWS = [
    {"t": 0, "source": "learner.sft", "kind": "sft_update", "step": 0, "sft_update": 3, "loss": 2.0},
    {"t": 0, "source": "sandbox", "kind": "rollout", "step": -1, "reward": 1.0, "ok": 1},
    {"t": 0, "source": "learner.rl", "kind": "rl_step", "step": 1, "reward": 0.5, "warnings": ["no spread"]},
    {"t": 0, "source": "eval", "kind": "eval", "step": 1, "pass@1/overall": 0.25},
    {"t": 0, "source": "tree", "kind": "tree", "step": -1, "harness": "codex", "tree_tokens_trainable": 40},
    {"t": 0, "source": "tree", "kind": "tree", "step": -1, "harness": "claude-code", "tree_tokens_trainable": 7},
    {"t": 0, "source": "tree", "kind": "tree", "step": -1, "harness": "codex", "tree_tokens_trainable": 42},
    {"t": 0, "source": "learner.rl", "kind": "rl_step", "step": 2, "reward": 0.75},
]


def feed(run_dir: Path, names, rows=ROWS, statuses=("ok", "ok", "timeout")):
    tr = Trackers(names, run_dir, CONFIG, "[run]\nsteps = 2\n")
    for s in statuses:
        tr.status(s)
    for r in rows:
        tr.row(r)
    tr.close()


def test_rows_become_scalars_named_by_kind():
    assert scalars(ROWS[2]) == {"rl_step/reward": 0.5}  # step, t, source, warnings are bookkeeping
    assert scalars({"kind": "tree", "step": -1, "ok": True, "n": 2}) == {"tree/n": 2.0}
    assert scalars({"kind": "tree", "step": -1, "harness": "codex", "tree_tokens_trainable": 9}) == {
        "tree/codex/tree_tokens_trainable": 9.0}  # a row about one harness


def test_a_missing_package_is_named_with_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    assert tracker_problem(["tensorboard"]) == ""
    assert tracker_problem(["tensorboard", "wandb"]) == ("trackers ['wandb']: the package is not installed; "
                                                         "pip install -e '.[trackers]'")


def test_tensorboard_gets_every_kind_against_its_own_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    feed(tmp_path, ["tensorboard"])
    ea = EventAccumulator(str(tmp_path / "tensorboard"))
    ea.Reload()
    got = {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}
    assert got["rl_step/reward"] == [(1, 0.5), (2, 0.75)]
    assert got["sft_update/loss"] == [(3, 2.0)]  # the SFT update's number
    assert got["eval/pass@1/overall"] == [(1, 0.25)]
    assert got["rollouts/ok"] == [(1, 2.0), (2, 2.0)] and got["rollouts/timeout"] == [(1, 1.0), (2, 1.0)]
    assert got["rollout/reward"] == [(1, 1.0)]  # per-event kinds: counted
    assert got["tree/codex/tree_tokens_trainable"] == [(1, 40.0), (2, 42.0)]  # per harness, each its own count
    assert got["tree/claude-code/tree_tokens_trainable"] == [(1, 7.0)]
    assert {"config/text_summary", "rl_step/warnings/text_summary"} <= set(ea.Tags()["tensors"])


def test_wandb_offline_keeps_config_history_and_one_run_across_a_resume(tmp_path):
    pytest.importorskip("wandb")
    feed(tmp_path, ["wandb"], rows=ROWS[:3])
    feed(tmp_path, ["wandb"], rows=ROWS[3:], statuses=())  # the run resumed: the same W&B run continues
    runs = offline_runs(tmp_path)
    assert len(runs) == 2 and len({i for r in runs for i in r["ids"]}) == 1
    assert runs[0]["config"]["learner"] == CONFIG["learner"]
    rows = [h for r in runs for h in r["history"]]
    rl = [(h["rl_step/_step"], h["rl_step/reward"]) for h in rows if "rl_step/reward" in h]
    assert rl == [(1, 0.5), (2, 0.75)]
    assert any(h.get("rl_step/warnings") == "no spread" for h in rows)
    assert any(h.get("eval/pass@1/overall") == 0.25 for h in rows)
    assert any(h.get("rollouts/ok") == 2 for h in rows)


@pytest.mark.anyio
async def test_a_hot_reload_is_a_note_at_the_current_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from actors.monitor import Monitor, MonitorSettings
    from pipeline.messages import ConfigChanged
    from pipeline.monitor.state import MonitorState

    mon = Monitor("monitor", MonitorSettings(trackers=["tensorboard"]))
    mon.state = MonitorState(run_name="r", t0=0.0, rl_steps_done=3)
    mon.trackers = Trackers(["tensorboard"], tmp_path, CONFIG, "")
    await mon.on_reload(ConfigChanged(section="scheduler", changes={"temperature": 0.7}))
    await mon.on_reload(ConfigChanged(section="*", changes={}, accepted=False, reason="fixed field(s) changed"))
    mon.trackers.close()
    ea = EventAccumulator(str(tmp_path / "tensorboard"))
    ea.Reload()
    notes = [(e.step, e.tensor_proto.string_val[0].decode()) for e in ea.Tensors("config/reload/text_summary")]
    assert notes == [(3, "[scheduler] {'temperature': 0.7}"), (3, "refused, nothing applied: fixed field(s) changed")]
