"""The checkout stays lint-clean: ruff, with the settings in pyproject.toml, over every Python file.

ruff is pinned in the `test` extra (its default rule set moves between releases); without it this test skips on
a developer's machine and fails in CI."""

import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers.ci import require

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    require(ruff is not None, "ruff is not installed (pip install -e '.[test]')")
    r = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                       capture_output=True, text=True, check=False, timeout=120)
    assert r.returncode == 0, f"ruff check . found problems (fix them, or `ruff check --fix .`):\n{r.stdout[-4000:]}"
