"""`run.py --replay LOG`'s per-harness numbers, on a recorded quickstart log (fast: no run)."""

import gzip
import shutil
from pathlib import Path

from pipeline.cli.harness_report import report, text

DATA = Path(__file__).resolve().parents[1] / "data"


def test_per_harness_numbers_of_a_recorded_log(tmp_path):
    log = tmp_path / "events.msgpack"
    with gzip.open(DATA / "quickstart-schema1.events.msgpack.gz") as f, log.open("wb") as out:
        shutil.copyfileobj(f, out)
    (s,) = report(log)
    assert (s.harness, s.rollouts, s.demonstrations, s.settled, s.statuses) == (
        "whitebox:S0T0O0C0W0", 28, 16, 28, {"ok": 28})
    assert s.sft_packs == 2 and s.groups_dropped == 0
    assert s.groups_trained is None  # written before PolicyUpdated listed its groups
    assert s.calls == round(s.calls_per_rollout * 28) and 0 < s.input_tokens_per_call <= s.max_input_tokens
    assert 0 < s.harness_s_mean <= s.harness_s_max
    lines = text([s]).splitlines()
    assert lines[0].startswith("harness") and lines[1].split()[:4] == ["whitebox:S0T0O0C0W0", "28", "16", "28"]
    assert lines[1].split()[-4] == "?"
