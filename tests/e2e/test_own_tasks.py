"""The README's "Bring your own model and tasks" file, as a new user copies it: it validates and trains.

The snippet is read from README.md itself (so the test follows the page), with the task folder pointed at a Harbor
task of tests/data and only the sizes cut with --set: one RL step of one group of two. Real parts: a small policy
built on first use, the embedded engine, real Codex in Docker sandboxes over the task's own image, its verifier.
"""

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.helpers.cli import run_py
from tests.helpers.docker import require_images

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.harness]


def readme_snippet() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Bring your own model and tasks"):]
    return re.search(r"```toml\n(.*?)```", section, re.DOTALL).group(1)


def test_the_readme_own_tasks_file_validates_and_trains(tmp_path):
    require_images()
    snippet = readme_snippet()
    assert len([line for line in snippet.splitlines() if line.strip()]) <= 12  # "in about ten lines"
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    shutil.copytree(ROOT / "tests" / "data" / "harbor" / "greeting", tasks / "greeting")
    mine = tmp_path / "my.toml"
    mine.write_text(snippet.replace("/data/tasks", str(tasks))
                    .replace('"runs/cache/my-policy"', json.dumps(str(tmp_path / "my-policy"))))
    v = run_py("--experiment", str(mine), "--validate")
    assert v.returncode == 0, v.stderr[-3000:]
    assert 'preset "train"' in v.stdout
    run_dir = tmp_path / "run"
    # this machine has no network for sandboxes: build and verify offline (the snippet lets test.sh go online)
    sets = ["run.steps=1", "run.groups_per_step=1", "scheduler.group_size=2", 'monitor.display="off"',
            'sandbox.docker.verifier_network="none"', 'sandbox.docker.build_network="none"',
            "experiment.build_model.tasks=20", "experiment.build_model.hidden_size=32"]
    r = run_py("--experiment", str(mine), "--run-dir", str(run_dir), "--no-watch",
               *(x for s in sets for x in ("--set", s)))
    assert r.returncode == 0, r.stderr[-4000:]
    rl = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if m["kind"] == "rl_step"]
    assert [m["step"] for m in rl] == [1]
    summary = run_py("--replay", str(run_dir), "--json")
    statuses = json.loads(summary.stdout)["statuses"]
    assert sum(statuses.values()) == 2 and statuses.get("ok", 0) >= 1, statuses
