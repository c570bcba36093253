"""The monitor's pure parts: folding Metrics by kind, phase, progress, ETA, and the "not measured yet" cases."""

import json

import pytest
from rich.console import Console

from pipeline.messages import Metric
from pipeline.monitor.display import (
    duration,
    eta_s,
    phase,
    policy_text,
    progress_fields,
    progresses,
    render,
    rows,
    step_fields,
)
from pipeline.monitor.metrics import load_metrics, of_kind, record
from pipeline.monitor.state import MonitorState, absorb

T0 = 1000.0


def state(**plan):
    s = MonitorState(run_name="run", t0=T0)
    if plan:
        absorb(s, Metric(source="sch", kind="scheduler", values={"groups_in_flight": 4, "policy_version": 0, **plan}),
               T0 + 0.1)
    return s


def demos(s, n, t, dt=1.0):
    for i in range(n):
        absorb(s, Metric(source="sb", kind="demonstration", values={"reward": 1.0, "rollouts_running": 3}), t + i * dt)


def sft(s, n, t, total, dt=0.5, version0=0):
    for i in range(n):
        absorb(s, Metric(source="lrn.sft", kind="sft_update", step=0, values={
            "loss": 1.0 / (i + 1), "sft_epoch": i // 4, "sft_updates": total, "version": version0 + i + 1,
            "tokens_per_s": 1000.0}), t + i * dt)


def rl_step(s, step, t, reward=0.25, version=None):
    v = {"reward": reward, "pass_rate": reward, "entropy": 0.3, "kl": 0.01, "loss": 0.1, "tokens_per_s": 500.0}
    if version is not None:
        v["version"] = version
    absorb(s, Metric(source="lrn.rl", kind="rl_step", step=step, values=v), t)


def by_label(s, now):
    return {p.label: p for p in progresses(s, now)}


# ------------------------------------------------------------------------------------------------ phase
def test_phases_of_a_run_with_a_cold_start():
    s = MonitorState(run_name="run", t0=T0)
    assert phase(s) == "starting"
    s = state(demonstrations_total=4, steps_total=2)
    assert phase(s) == "demonstrations"
    demos(s, 3, T0 + 5)
    assert phase(s) == "demonstrations"
    demos(s, 1, T0 + 9)
    assert phase(s) == "sft"  # all recorded, the trees are being packed: SFT is next
    sft(s, 3, T0 + 10, total=4)
    assert phase(s) == "sft"
    sft(s, 1, T0 + 12, total=4)
    assert phase(s) == "rl"  # SFT done, the first RL rollouts are on their way
    rl_step(s, 1, T0 + 20)
    assert phase(s) == "rl"
    rl_step(s, 2, T0 + 30)
    assert phase(s) == "done"


def test_phases_without_a_cold_start_and_on_resume():
    s = state(demonstrations_total=0, steps_total=3)
    assert phase(s) == "rl"
    s = state(demonstrations_total=0, steps_total=3)
    rl_step(s, 3, T0 + 5)  # a resumed run: its first step is number 3
    assert phase(s) == "done"


def test_dispatch_is_on_the_kind_not_on_the_actor_name():
    s = state(demonstrations_total=2, steps_total=5)
    absorb(s, Metric(source="trainer-7", kind="rl_step", step=1, values={"reward": 0.5}), T0 + 1)
    absorb(s, Metric(source="learner.rl", kind="other", step=2, values={"reward": 0.9}), T0 + 2)
    absorb(s, Metric(source="sandbox", kind="tree", values={"reward": 1.0}), T0 + 3)
    assert s.rl_steps_done == 1 and s.rl_rewards == [0.5]
    assert s.demos_done == 0 and s.rl_rollouts == 0


# -------------------------------------------------------------------------------------------------- ETA
def test_eta_needs_a_total_and_a_measured_interval():
    assert eta_s([], 10, T0) is None
    assert eta_s([T0], None, T0) is None
    assert eta_s([T0], 10, T0) is None  # one item and no start: no interval measured yet
    assert eta_s([T0 + 4], 10, T0 + 4, start=T0) == pytest.approx(36.0)
    assert eta_s([T0, T0 + 1], 2, T0 + 5) == 0.0


def test_eta_uses_the_recent_pace_and_counts_down():
    times = [T0, T0 + 10, T0 + 20, T0 + 21, T0 + 22, T0 + 23, T0 + 24, T0 + 25]
    assert eta_s(times, 10, T0 + 25, window=5) == pytest.approx(2.0)  # 1 s per item lately, 2 left
    assert eta_s(times, 10, T0 + 25, window=None) == pytest.approx(2 * 25 / 7)
    assert eta_s(times, 10, T0 + 26, window=5) == pytest.approx(1.0)
    assert eta_s(times, 10, T0 + 90, window=5) == 0.0  # late: never negative


def test_eta_of_a_resumed_run_counts_the_steps_before_it():
    # 2 steps measured in this run, 6 done in all (4 from the checkpoint): 4 left at 10 s each
    assert eta_s([T0 + 10, T0 + 20], 10, T0 + 20, start=T0, done=6) == pytest.approx(40.0)


def test_duration():
    assert [duration(x) for x in (0, 12.4, 59.6, 65, 3725)] == ["0 s", "12 s", "1:00", "1:05", "1:02:05"]


# --------------------------------------------------------------------------------------------- progress
def test_progress_before_anything_was_measured():
    s = state(demonstrations_total=8, steps_total=3)
    p = by_label(s, T0 + 1)
    assert list(p) == ["demonstrations", "SFT updates", "RL steps"]
    assert (p["demonstrations"].count, p["demonstrations"].when) == ("0 / 8", "ETA -")
    assert (p["SFT updates"].count, p["SFT updates"].when) == ("0 / ?", "ETA -")  # total not announced yet
    assert (p["RL steps"].count, p["RL steps"].when) == ("0 / 3", "ETA -")


def test_progress_through_the_cold_start_and_rl():
    s = state(demonstrations_total=4, steps_total=3)
    demos(s, 2, T0 + 10, dt=2.0)  # at T0+10 and T0+12: 2 s per demonstration
    p = by_label(s, T0 + 12)
    assert (p["demonstrations"].count, p["demonstrations"].when) == ("2 / 4", "ETA 4 s")
    demos(s, 2, T0 + 14, dt=2.0)
    sft(s, 2, T0 + 20, total=6)
    p = by_label(s, T0 + 20.5)
    assert p["demonstrations"].when == "done in 16 s"
    assert (p["SFT updates"].count, p["SFT updates"].when) == ("2 / 6", "ETA 2 s")
    sft(s, 4, T0 + 21, total=6)
    rl_step(s, 1, T0 + 32.5)
    p = by_label(s, T0 + 35)
    assert p["SFT updates"].when.startswith("done in")
    assert (p["RL steps"].count, p["RL steps"].when) == ("1 / 3", "ETA 18 s")  # 10 s per step, 2 left, 2 s in
    assert p["RL steps"].note == "step 2 running 2 s"
    rl_step(s, 2, T0 + 42.5)
    rl_step(s, 3, T0 + 52.5)
    assert by_label(s, T0 + 60)["RL steps"].when == "done in 30 s"
    r = dict(rows(s, T0 + 60))  # what was in flight at the last report is stopped, not running
    assert r["groups in flight"] == "-" and r["rollouts"].startswith("- running")


def test_no_cold_start_shows_only_rl_steps():
    s = state(demonstrations_total=0, steps_total=2)
    assert [p.label for p in progresses(s, T0)] == ["RL steps"]


# ---------------------------------------------------------------------------------- what the rows say
def test_nothing_measured_reads_n_a_not_zero():
    s = state(demonstrations_total=4, steps_total=2)
    r = dict(rows(s, T0 + 3))
    for k in ("reward", "pass rate", "entropy", "KL to the reference"):
        assert r[k] == "n/a (no RL step yet)", k
    assert r["SFT loss"] == "-" and r["learner throughput"] == "-" and r["weight sync"] == "-"
    assert r["rollouts"].startswith("- running")  # no sandbox has reported yet
    assert "0.000" not in " ".join(r.values())


def test_rows_after_rl_steps():
    s = state(demonstrations_total=0, steps_total=10)
    for i, reward in enumerate([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]):
        rl_step(s, i + 1, T0 + 10 * (i + 1), reward=reward)
    r = dict(rows(s, T0 + 70))
    assert r["reward"] == "0.600 last step · 0.400 mean of the last 5"
    assert r["pass rate"] == "0.600 last step"
    assert r["entropy"] == "0.300 nats/token"
    assert r["KL to the reference"] == "0.0100 per token (k3)"
    assert r["groups in flight"] == "4"
    assert r["learner throughput"] == "500 tokens/s (last RL step)"
    assert r["elapsed"] == "1:10"


def health(step, groups, flat=0, ok=0, failed=0, **more):
    """An RL step's values as the learner sends them (pipeline.training.health's counts)."""
    v = {"groups": groups, "groups_dropped": 0, "stale_groups": 0, "rollouts": ok + failed, "rollouts_ok": ok,
         "rollouts_timeout": 0, "rollouts_sandbox_error": 0, "rollouts_harness_error": failed,
         "rollouts_verifier_error": 0, "rollouts_trained": ok, "rollouts_left_out": failed, **more}
    if groups:
        v.update(zero_var_groups=flat, zero_var_frac=flat / groups, reward=0.0, pass_rate=0.0, entropy=0.5, loss=0.0)
    return v


def test_steps_that_could_not_learn_say_why():
    s = state(demonstrations_total=0, steps_total=10)
    failed = "step 1: no successful rollout: 4 harness_error; left out: 4x harness_error, exit code 1 (first: ...)"
    absorb(s, Metric(source="lrn.rl", kind="rl_step", step=1, values=health(1, 0, failed=4), warnings=[failed]),
           T0 + 10)
    r = dict(rows(s, T0 + 11))
    assert r["KL to the reference"] == "n/a (no policy gradient in step 1: nothing trained)"  # not "no RL step yet"
    assert r["entropy"] == r["pass rate"] == r["reward"] == r["reward spread"] == "n/a (nothing trained in step 1)"
    assert r["last step's rollouts"] == "4 harness_error · 4 left out of the loss"
    assert r["warning"] == failed
    flat = "step 2: no reward spread in 2/2 groups (all rewards 0.0): the policy gradient is zero; rollouts: 8 ok"
    absorb(s, Metric(source="lrn.rl", kind="rl_step", step=2, values=health(2, 2, flat=2, ok=8), warnings=[flat]),
           T0 + 20)  # kl_coef = 0: no KL measured
    r = dict(rows(s, T0 + 21))
    assert r["KL to the reference"] == "n/a (no policy gradient in steps 1-2: nothing trained, no reward spread)"
    assert r["reward spread"] == "0 / 2 groups last step (2 scored alike: no signal)"
    assert r["last step's rollouts"] == "8 ok" and r["warning"] == flat and r["reward"].startswith("0.000 last")
    absorb(s, Metric(source="lrn.rl", kind="rl_step", step=3, values=health(3, 2, flat=2, ok=8, kl=0.0)), T0 + 30)
    assert dict(rows(s, T0 + 31))["KL to the reference"] == (
        "0.0000 per token (k3); no policy gradient in steps 1-3: nothing trained, no reward spread")
    absorb(s, Metric(source="lrn.rl", kind="rl_step", step=4, values=health(4, 2, flat=1, ok=8, kl=0.01)), T0 + 40)
    r = dict(rows(s, T0 + 41))
    assert r["KL to the reference"] == "0.0100 per token (k3)" and "warning" not in r  # learning again
    assert r["reward spread"] == "1 / 2 groups last step (1 scored alike: no signal)"
    absorb(s, Metric(source="lrn.rl", kind="rl_step", step=5, values=health(5, 2, ok=8)), T0 + 50)
    r = dict(rows(s, T0 + 51))
    assert r["KL to the reference"] == "n/a (no KL term: [learner.train].kl_coef = 0)"
    assert r["reward spread"] == "2 / 2 groups last step"
    absorb(s, Metric(source="lrn.rl", kind="rl_step", step=7, values=health(7, 2, flat=2, ok=8)), T0 + 60)
    assert dict(rows(s, T0 + 61))["KL to the reference"] == "n/a (no policy gradient in step 7: no reward spread)"


def test_the_warning_is_drawn_in_the_panel():
    s = state(demonstrations_total=0, steps_total=3)
    w = "step 1: no reward spread in 8/8 groups (all rewards 0.0): the policy gradient is zero; rollouts: 64 ok"
    absorb(s, Metric(source="lrn.rl", kind="rl_step", step=1, values=health(1, 8, flat=8, ok=64), warnings=[w]),
           T0 + 5)
    c = Console(width=120, record=True, color_system=None)
    c.print(render(s, T0 + 6))
    text = " ".join(c.export_text().replace("│", " ").split())  # the panel wraps the line in its last column
    assert f"warning {w}" in text and "no RL step yet" not in text
    assert "no policy gradient in step 1: no reward spread" in text


def test_policy_version_says_what_it_is_made_of():
    s = state(demonstrations_total=4, steps_total=2)
    assert policy_text(s) == "v0: the initial weights (the demonstrations are scripted, not sampled)"
    demos(s, 4, T0 + 1)
    sft(s, 160, T0 + 10, total=160, dt=0.1)
    # the learner is at v160, the engine still serves v0 until the SFT weights are pushed
    assert policy_text(s).startswith("v0: the initial weights")
    absorb(s, Metric(source="px", kind="weight_sync", values={"policy_version": 160, "weight_update_s": 0.2}), T0 + 30)
    assert policy_text(s) == "v160: 160 SFT updates + 0 RL updates"  # why it reads 160 before any RL step
    rl_step(s, 1, T0 + 40, version=161)
    assert policy_text(s) == "v160: 160 SFT updates + 0 RL updates; the learner is at v161"
    absorb(s, Metric(source="px", kind="weight_sync", values={"policy_version": 161, "weight_update_s": 0.2}), T0 + 41)
    assert policy_text(s) == "v161: 160 SFT updates + 1 RL update"
    assert dict(rows(s, T0 + 42))["weight sync"] == "0.20 s (the engine's last load)"


def test_policy_version_of_a_resumed_run_and_without_a_report():
    s = MonitorState(run_name="run", t0=T0)
    assert policy_text(s) == "-"
    s = state(demonstrations_total=0, steps_total=10, policy_version=165)  # resumed: no SFT seen in this run
    assert policy_text(s) == "v165 (one version per optimizer update, SFT included)"


# ----------------------------------------------------------------------------------- renderable, logs
def test_render_names_the_run_and_the_phase():
    s = state(demonstrations_total=4, steps_total=2)
    demos(s, 1, T0 + 2)
    c = Console(width=120, record=True, color_system=None)
    c.print(render(s, T0 + 3))
    text = c.export_text()
    assert "bridle · run · cold start: recording demonstrations" in text
    assert "1 / 4" in text and "0 / ?" in text and "0 / 2" in text
    assert "n/a (no RL step yet)" in text


def test_log_fields():
    s = state(demonstrations_total=4, steps_total=2)
    demos(s, 2, T0 + 2)
    assert progress_fields(s, T0 + 3) == {"phase": "cold start: recording demonstrations",
                                          "demonstrations": "2/4 (ETA 2 s)", "SFT_updates": "0/? (ETA -)",
                                          "RL_steps": "0/2 (ETA -)"}
    assert step_fields(3, {"reward": 0.12345, "loss": 0.123456, "tokens_per_s": 9.0}) == {
        "step": 3, "reward": 0.123, "loss": 0.1235}


# -------------------------------------------------------------------------------------------- metrics.jsonl
def test_metrics_jsonl_keeps_the_source_and_gains_the_kind(tmp_path):
    m = Metric(source="learner.rl", kind="rl_step", step=2, values={"reward": 0.5})
    assert record(m, 5.0) == {"t": 5.0, "source": "learner.rl", "kind": "rl_step", "step": 2, "reward": 0.5}
    # the learner's optimizer counter in values does not replace the RL step (it restarts after SFT)
    clash = Metric(source="l", kind="rl_step", step=3, values={"step": 1.0, "reward": 0.2}, t=7.0)
    assert record(clash, 9.0) == {"t": 7.0, "source": "l", "kind": "rl_step", "step": 3, "value_step": 1.0,
                                  "reward": 0.2}
    path = tmp_path / "metrics.jsonl"
    old = [{"t": 1, "source": "learner.rl", "step": 1, "reward": 0.1},  # written before Metric.kind existed
           {"t": 2, "source": "learner.sft", "step": 0, "loss": 2.0},
           {"t": 3, "source": "sandbox", "step": -1, "reward": 1.0}]
    warned = Metric(source="l", kind="rl_step", step=4, values={"groups": 0.0, "warnings": 1.0},
                    warnings=["step 4: nothing trained"])
    assert record(warned, 9.0) == {"t": 9.0, "source": "l", "kind": "rl_step", "step": 4,
                                   "warnings": ["step 4: nothing trained"], "groups": 0.0, "value_warnings": 1.0}
    assert "warnings" not in record(m, 5.0)  # only when there are some
    path.write_text("\n".join(json.dumps(x) for x in [*old, record(m, 5.0)]) + "\n{\"cut by a cr")
    rows_ = load_metrics(path)
    assert [r["kind"] for r in rows_] == ["rl_step", "sft_update", "other", "rl_step"]
    assert [r["step"] for r in of_kind(rows_, "rl_step")] == [1, 2]
