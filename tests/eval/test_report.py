"""Report tables from hand-made samples, where every number can be checked by hand."""

import msgspec
import pytest

from pipeline.eval.report import Report, Sample, build_report, markdown, write


def s(task, harness, reward, status="ok", column="in-space", family="create_word"):
    return Sample(task_id=task, family=family, harness=harness, column=column, status=status, reward=reward)


def test_pairs_are_the_unit_and_infrastructure_failures_are_excluded():
    samples = [
        # t1 x A: 2 of 3 succeed (the verifier error is not the policy's and is left out)
        s("t1", "A", 1.0), s("t1", "A", 1.0), s("t1", "A", 0.0), s("t1", "A", 0.0, "verifier_error"),
        # t2 x A: 0 of 2; the timeout counts as a miss
        s("t2", "A", 0.0), s("t2", "A", 0.0, "timeout"),
        # t1 x B, out of space: 1 of 2, reward 0.5 is partial credit, not a success
        s("t1", "B", 1.0, column="out-of-space"), s("t1", "B", 0.5, column="out-of-space"),
    ]
    rep = build_report(samples, [1, 2])
    all_ = rep.row("overall", "all")
    assert (all_.pairs, all_.rollouts, all_.excluded) == (3, 7, 1)
    # per-pair pass@1: 2/3, 0, 1/2
    assert all_.pass_at[1].mean == pytest.approx((2 / 3 + 0 + 0.5) / 3)
    # pass@2 per pair: 1 - C(1,2)/C(3,2) = 1; 0; 1 - C(1,2)/C(2,2) = 1
    assert all_.pass_at[2].mean == pytest.approx(2 / 3)
    # pass^2 per pair: C(2,2)/C(3,2) = 1/3; 0; 0
    assert all_.pass_hat[2].mean == pytest.approx(1 / 9)
    assert all_.mean_reward.mean == pytest.approx((2 / 3 + 0 + 0.75) / 3)
    a = rep.row("harness", "A")
    assert (a.pairs, a.rollouts, a.excluded) == (2, 5, 1)
    oos = rep.row("column", "out-of-space")
    assert oos.pairs == 1 and oos.pass_at[1].low is None  # one pair: no interval, said so
    assert rep.row("family", "create_word").pairs == 3


def test_a_pair_with_fewer_samples_than_k_is_left_out_of_that_k():
    rep = build_report([s("t1", "A", 1.0), s("t2", "A", 1.0), s("t2", "A", 0.0)], [1, 2])
    row = rep.row("overall", "all")
    assert row.pass_at[1].n == 2 and row.pass_at[2].n == 1
    assert row.pass_at[2].mean == 1.0


def test_nothing_measured_reads_n_a_not_100_percent(tmp_path):
    rep = build_report([s("t1", "A", 0.0, "sandbox_error")], [1])
    row = rep.row("overall", "all")
    assert row.pairs == 0 and row.pass_at[1].mean is None
    md = markdown(rep)
    assert "n/a (n=0)" in md and "100" not in md
    paths = write(rep, tmp_path / "eval")
    assert [p.name for p in paths] == ["report.json", "report.md", "pass_at_k.png"]
    back = msgspec.json.decode(paths[0].read_bytes(), type=Report)
    assert back.row("overall", "all").excluded == 1
    assert paths[2].stat().st_size > 1000


def test_eval_rounds_are_plotted_against_the_step(tmp_path):
    import json

    from pipeline.monitor.plots import write_plots

    rows = [{"t": 0, "source": "eval", "kind": "eval", "step": s, "pass@1": 0.1 * s, "held-out/pass@1": 0.05 * s}
            for s in (0, 2, 4)]
    rows.append({"t": 0, "source": "eval", "kind": "eval", "step": -1, "pass@1": 0.9})  # standalone: not a step
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    written = write_plots(tmp_path / "metrics.jsonl", tmp_path)
    assert [p.name for p in written] == ["plots.png", "eval.png"]
    assert (tmp_path / "eval.png").stat().st_size > 1000
