"""A training run with [sandbox.judge] against a real endpoint (a subprocess): every verified rollout's reward is
the configured mix, and the API key appears nowhere in the run folder."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.eventlog import EventLogReader
from pipeline.messages import PolicyUpdated, RolloutFinished
from tests.helpers.judge_server import REASON_CANARY, judge_server

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-run-secret-5b1e0c"
pytestmark = pytest.mark.slow


def test_a_run_mixes_the_judge_into_every_reward(tmp_path):
    script = tmp_path / "script.json"  # every rollout writes a file, then says it is done
    script.write_text(json.dumps({"default": [
        {"tool_calls": [{"name": "write_file", "arguments": {"path": "a.txt", "content": "x"}}]},
        {"text": "Done."}]}))
    rubric = tmp_path / "rubric.md"
    rubric.write_text("Full marks when the requested file holds the requested words.")
    run_dir = tmp_path / "run"
    with judge_server(KEY) as server:
        sets = [
            f'run.model="{tmp_path / "model"}"', "experiment.build_model.tasks=20",
            f'proxy.engine={{kind="scripted", script="{script}"}}',
            "scheduler.sft_groups=0", "run.steps=1", "run.groups_per_step=2", "scheduler.group_size=2",
            "scheduler.tasks.count=10", 'monitor.display="off"',
            f'sandbox.judge.base_url="{server.url}"', 'sandbox.judge.model="score:0.5#run"',
            'sandbox.judge.api_key_env="BRIDLE_E2E_JUDGE_KEY"', f'sandbox.judge.default_rubric="{rubric}"',
            "sandbox.judge.weight=0.4",
        ]
        args = [sys.executable, "run.py", "--experiment", "quickstart", "--run-dir", str(run_dir), "--no-watch"]
        for s in sets:
            args += ["--set", s]
        env = {**os.environ, "BRIDLE_E2E_JUDGE_KEY": KEY}
        r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
        assert r.returncode == 0, r.stderr[-3000:]
        asked = server.requests("score:0.5#run")

    evs = list(EventLogReader(run_dir / "events.msgpack"))
    finished = [e.msg for e in evs if isinstance(e.msg, RolloutFinished)]
    verified = [f for f in finished if f.status in ("ok", "timeout")]
    assert len(verified) >= 3, [(f.status, f.details) for f in finished]
    for f in verified:
        assert set(f.rewards) >= {"rule", "judge"} and f.rewards["judge"] == 0.5, f.rewards
        assert f.reward == pytest.approx(0.6 * f.rewards["rule"] + 0.4 * 0.5), f
    assert len(asked) == len(verified) and all(a["auth_ok"] for a in asked)
    assert [e.msg.step for e in evs if isinstance(e.msg, PolicyUpdated)] == [1]
    for p in run_dir.rglob("*"):  # the key only by its variable's name
        assert not p.is_file() or KEY.encode() not in p.read_bytes(), p
    assert 'api_key_env = "BRIDLE_E2E_JUDGE_KEY"' in (run_dir / "config.toml").read_text()
    assert REASON_CANARY.encode() not in (run_dir / "events.msgpack").read_bytes()  # what the judge said: log only
