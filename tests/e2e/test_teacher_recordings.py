"""A teacher recorded through bridle, and a student's cold start from the recording (rejection-sampled).

Real parts: the teacher is another bridle process (`run.py --serve`, an OpenAI-compatible endpoint playing a script
that solves one of the two tasks), reached over HTTP by `[proxy.engine] kind = "openai"`; the white-box harness in
local sandboxes and the tasks' verifiers score what the teacher did; the student run reads the evaluation's event
log, keeps the verified success only and trains on it with the embedded engine and the learner.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from pipeline.core.eventlog import EventLogReader
from pipeline.messages import ModelCall, SettledRollout, ids
from pipeline.monitor.metrics import load_metrics, of_kind
from pipeline.rollout.taskgen import generate
from tests.helpers.cli import run_py

ROOT = Path(__file__).resolve().parents[2]
TASKS = 'eval.tasks={tasks="builtin:create_word", count=2, seed=5000}'


def teacher_script(path: Path) -> None:
    """Solve the first held-out task (file and word read from its generator), whichever task a rollout has: two
    rollouts, one after the other, each a write then "Done."."""
    name, word = generate("create_word", 5000).instruction.removeprefix("Create file ").split(" containing: ")
    solve = {"tool_calls": [{"name": "write_file", "arguments": {"path": name, "content": word}}]}
    path.write_text(json.dumps({"default": [solve, {"text": "Done."}] * 2}))


def test_a_teacher_is_recorded_and_a_student_learns_from_its_verified_rollouts(tmp_path):
    teacher_script(tmp_path / "teacher.json")
    serve = subprocess.Popen(
        [sys.executable, "run.py", "--serve", "--experiment", "serve", "--run-dir", str(tmp_path / "teacher"),
         "--set", f'proxy.engine.script="{tmp_path / "teacher.json"}"'],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        info = json.loads(serve.stdout.readline())
        os.environ["BRIDLE_TEST_TEACHER_KEY"] = info["token"]
        engine = (f'proxy.engine={{kind="openai", url="{info["openai_base_url"]}", served_model="policy", '
                  'api_key_env="BRIDLE_TEST_TEACHER_KEY"}')
        r = run_py("--eval", "--experiment", "quickstart", "--no-watch", "--run-dir", str(tmp_path / "eval"),
                   *(x for s in (engine, TASKS, "eval.samples=1", "eval.max_groups_in_flight=1", "eval.ks=[1]",
                                 'monitor.display="off"') for x in ("--set", s)))
    finally:
        os.environ.pop("BRIDLE_TEST_TEACHER_KEY", None)
        serve.send_signal(signal.SIGINT)
        serve.wait(timeout=30)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "evaluated the teacher 'policy' at http://127.0.0.1:" in r.stdout
    assert "| overall | all | 2 | 2 | 0 | 0.500" in r.stdout  # one task solved, one not: the verifiers tell them apart
    taught = [e.msg for e in EventLogReader(tmp_path / "teacher" / "events.msgpack") if isinstance(e.msg, ModelCall)]
    assert len(taught) == 4  # the teacher answered every call of both rollouts
    solved = [e.msg for e in EventLogReader(tmp_path / "eval" / "events.msgpack")
              if isinstance(e.msg, SettledRollout) and e.msg.finished.reward == 1.0]
    assert len(solved) == 1
    assert all(not ids(c.logprobs).any() for c in solved[0].calls)  # not the policy's: recorded as 0, never used
    demo_tokens = sum(len(ids(c.output_ids)) for c in solved[0].calls)

    log = tmp_path / "eval" / "events.msgpack"
    r = run_py("--experiment", "quickstart", "--no-watch", "--run-dir", str(tmp_path / "student"),
               *(x for s in ("run.steps=0", "scheduler.sft_groups=0", "learner.sft_epochs=3",
                             f'scheduler.sft_recordings={{logs=["{log}"]}}', 'monitor.display="off"')
                 for x in ("--set", s)))
    assert r.returncode == 0, r.stderr[-3000:]
    kept = [json.loads(line) for line in (tmp_path / "student" / "log.jsonl").read_text().splitlines()
            if '"recorded demonstrations"' in line]
    assert [(k["rollouts"], k["kept"], k["left_out"]) for k in kept] == [(2, 1, {"reward below 1": 1})]
    sft = of_kind(load_metrics(tmp_path / "student" / "metrics.jsonl"), "sft_update")
    assert [m["sft_update"] for m in sft] == [1, 2, 3]
    assert {m["trainable_tokens"] for m in sft} == {demo_tokens}  # exactly the teacher's answers, nothing else
    assert sft[-1]["sft_loss"] < sft[0]["sft_loss"]
    assert (tmp_path / "student" / "weights").is_dir()
