"""``python run.py ...`` from the repository root, as a user types it: its exit code and output, never raising;
``run_py_together`` runs independent commands side by side (each is mostly a Python start-up, a model load and
waiting on sandboxes, so two at a time save wall time on the test machine's two cores)."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_py(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)


def run_py_together(*commands: list[str], timeout: float = 900) -> list[subprocess.CompletedProcess]:
    """Each command's result, in order; the commands must not depend on each other's output."""
    with ThreadPoolExecutor(max_workers=len(commands)) as pool:
        return list(pool.map(lambda c: run_py(*c, timeout=timeout), commands))
