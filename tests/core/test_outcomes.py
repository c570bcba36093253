"""How rollouts ended, as the display, the run's end and --replay say it."""

from pipeline.core.outcomes import REASON_CHARS, Outcomes
from pipeline.messages import RolloutFinished


def fin(status: str, details: str = "") -> RolloutFinished:
    return RolloutFinished(rollout_id="r", group_id="g", status=status, details=details)


def test_counts_first_reasons_and_the_verdict():
    o = Outcomes()
    assert not o.none_succeeded and o.counts_text() == "none finished yet"  # nothing ran: not a failure
    long_tail = "x" * 500
    o.add(fin("timeout", f"harness killed after 2s ([scheduler] timeout_s) {long_tail}\n"
                         "note: the task asks allow_internet = true; not honoured: the agent reaches only the proxy"))
    o.add(fin("timeout", "a later reason"))
    o.add(fin("sandbox_error", "\x1b[31mred\x1b[0m text\r\nsecond line"))
    assert o.none_succeeded and o.counts_text() == "timeout 2, sandbox_error 1"
    first = o.first["timeout"]
    head, note = first.split("; note: ")
    assert len(head) == REASON_CHARS and head.endswith("…")  # the verdict's line is cut...
    assert note == "the task asks allow_internet = true; not honoured: the agent reaches only the proxy"  # ...notes whole
    assert o.first["sandbox_error"] == "red text"  # no escape sequences, one line
    assert o.verdict().startswith("no rollout succeeded (3 finished: timeout 2, sandbox_error 1): timeout 2, first: ")
    o.add(fin("ok", "reward 1"))
    assert not o.none_succeeded
