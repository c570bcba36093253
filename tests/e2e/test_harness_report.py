"""`run.py --replay LOG`'s per-harness numbers, on a recorded quickstart log (fast: no run)."""

import gzip
import shutil
from pathlib import Path

from pipeline.cli.harness_report import report, text

DATA = Path(__file__).resolve().parents[1] / "data"


def test_per_harness_numbers_of_a_recorded_log(tmp_path):
    log = tmp_path / "events.msgpack"
    with gzip.open(DATA / "quickstart.events.msgpack.gz") as f, log.open("wb") as out:
        shutil.copyfileobj(f, out)
    (s,) = report(log)
    assert (s.harness, s.rollouts, s.demonstrations, s.settled, s.statuses) == (
        "whitebox:S0T0O0C0W0", 28, 16, 28, {"ok": 28})
    assert s.sft_packs == 2 and s.groups_dropped == 0
    assert s.groups_trained is None  # written before PolicyUpdated listed its groups
    assert s.calls == round(s.calls_per_rollout * 28) and 0 < s.input_tokens_per_call <= s.max_input_tokens
    assert 0 < s.harness_s_mean <= s.harness_s_max
    # 12 RL rollouts scored (the 16 demonstrations are not): the mean and its parts
    assert s.scored == 12 and s.reward_mean is not None and set(s.reward_parts) <= {"rule"}
    lines = text([s]).splitlines()
    assert lines[0].startswith("harness") and lines[1].split()[:4] == ["whitebox:S0T0O0C0W0", "28", "16", "28"]
    assert lines[1].split()[11] == "?"  # trained
    assert lines[1].endswith(f"reward {s.reward_mean:.2f}" + (f" (rule {s.reward_parts['rule']:.2f})"
                                                              if s.reward_parts else "") + " over 12 scored")


def test_reward_parts_and_nothing_scored():
    from pipeline.cli.harness_report import HarnessStats

    judged = HarnessStats(harness="h", scored=2, reward_mean=0.85, reward_parts={"rule": 1.0, "judge": 0.5})
    assert text([judged]).splitlines()[1].endswith("reward 0.85 (rule 1.00, judge 0.50) over 2 scored")
    assert text([HarnessStats(harness="h")]).splitlines()[1].endswith("reward n/a (0 scored)")
