"""Evaluation: pass@k / pass^k estimators with confidence intervals, behavioural metrics from trajectories, reports
(docs/evaluation.md)."""
