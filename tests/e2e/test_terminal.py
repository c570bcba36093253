"""What a person sees in a real terminal: a shortened quickstart inside tmux, its pane captured as it runs.

The live display must be drawn once and updated in place (the scroll-back holds one copy of it, not one per
refresh), show the phase and progress, let the log lines scroll above it, and leave the last frame and the run's
closing log lines on the screen when it ends.
"""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.ci import require

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

TITLE = "bridle · run"  # the panel's title: "bridle · <run dir name> · <phase>"
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z \[")


def test_live_display_updates_in_place_with_log_lines_above(tmp_path):
    tmux = shutil.which("tmux")
    require(tmux is not None, "tmux is not installed (apt-get install tmux)")
    model, run_dir = tmp_path / "model", tmp_path / "run"
    sets = [
        f'run.model="{model}"', "experiment.build_model.tasks=60",
        "scheduler.sft_groups=16", "tree.sft_pack=8", "learner.sft_epochs=2",
        "run.steps=2", "scheduler.group_size=3", "run.groups_per_step=2",
        "scheduler.tasks.count=40", "monitor.refresh_s=0.25",
    ]
    cmd = [sys.executable, "run.py", "--experiment", "quickstart", "--run-dir", str(run_dir), "--no-watch"]
    for s in sets:
        cmd += ["--set", s]
    script = tmp_path / "run.sh"
    script.write_text(f"cd {ROOT}\n{subprocess.list2cmdline(cmd)}\necho BRIDLE_EXIT=$?\nsleep 600\n")
    conf = tmp_path / "tmux.conf"
    conf.write_text("set -g history-limit 100000\n")
    sock = f"bridle-test-{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if k != "TMUX"}
    env["TERM"] = "xterm-256color"

    def tmux_(*args: str) -> str:
        r = subprocess.run([tmux, "-L", sock, "-f", str(conf), *args], capture_output=True, text=True, env=env,
                           timeout=30, check=True)
        return r.stdout

    tmux_("new-session", "-d", "-s", "q", "-x", "140", "-y", "45", f"bash {script}")
    screens: list[str] = []
    try:
        t0 = time.monotonic()
        while True:
            screen = tmux_("capture-pane", "-p", "-t", "q")
            screens.append(screen)
            if "BRIDLE_EXIT=" in screen:
                break
            assert time.monotonic() - t0 < 900, "the run did not end within 15 minutes:\n" + screen
            time.sleep(0.5)
        history = tmux_("capture-pane", "-p", "-t", "q", "-S", "-", "-E", "-")
    finally:
        subprocess.run([tmux, "-L", sock, "kill-server"], capture_output=True, env=env, check=False)

    assert "BRIDLE_EXIT=0" in screens[-1], history[-6000:]
    drawn = [s for s in screens if TITLE in s]
    assert len(drawn) >= 3, f"the live display showed in {len(drawn)} of {len(screens)} captures"
    for s in screens:
        assert s.count(TITLE) <= 1, "stacked copies of the live display:\n" + s
    # updated in place: the whole scroll-back holds the display once (its last frame)
    assert history.count(TITLE) == 1, f"{history.count(TITLE)} copies in the scroll-back"
    # progress, phase by phase
    # (the SFT phase of 4 updates may fall between two captures; recording and RL last seconds)
    seen = "\n".join(drawn)
    for phase in ("cold start: recording demonstrations", "RL"):
        assert f"{TITLE} · {phase} " in seen, phase
    assert re.search(r"demonstrations +\S+ +\d+ / 16 ", seen)
    assert re.search(r"SFT updates +\S+ +\d+ / (4|\?) ", seen)
    assert re.search(r"RL steps +\S+ +[0-2] / 2 ", seen)
    assert re.search(r"ETA (\d+ s|\d+:\d\d)", seen), "no measured ETA in any capture"
    # log lines flow above the display
    above = 0
    for s in drawn:
        lines = s.splitlines()
        top = next(i for i, ln in enumerate(lines) if TITLE in ln)
        above += sum(1 for ln in lines[:top] if LOG_LINE.match(ln))
    assert above > 0, "no log line above the live display"
    # it ends cleanly: the last frame says done, and the closing log lines follow it
    final = history[history.index(TITLE):]
    assert f"{TITLE} · done" in final
    assert re.search(r"RL steps +\S+ +2 / 2 +done in", final)
    assert "reward " in final and "n/a" not in final.split("reward ", 1)[1].splitlines()[0]
    assert final.index("╰") < final.index("run finished") < final.index("BRIDLE_EXIT=0")
