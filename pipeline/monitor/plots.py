"""PNG plots of a run's metrics.jsonl: reward, pass rate, entropy, throughput (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

from pipeline.monitor.metrics import load_metrics, of_kind


def write_plots(metrics_path: Path, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load_metrics(metrics_path)
    rl = of_kind(rows, "rl_step")
    sft = of_kind(rows, "sft_update")
    evals = [r for r in of_kind(rows, "eval") if r["step"] >= 0]
    panels = [
        ("reward", "reward (mean over the step's rollouts)", rl),
        ("pass_rate", "pass rate", rl),
        ("entropy", "entropy (nats/token)", rl),
        ("tokens_per_s", "learner throughput (tokens/s)", rl),
    ]
    written = []
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (key, title, src) in zip(axes.flat, panels, strict=True):
        pts = [(r["step"], r[key]) for r in src if key in r]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o", ms=3)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    p = out_dir / "plots.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    written.append(p)
    if sft:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ys = [r.get("loss", 0.0) for r in sft]
        ax.plot(range(len(ys)), ys)
        ax.set_title("cold-start SFT loss")
        ax.set_xlabel("SFT update")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        q = out_dir / "sft.png"
        fig.savefig(q, dpi=90)
        plt.close(fig)
        written.append(q)
    if evals:
        written.append(_eval_plot(plt, evals, out_dir / "eval.png"))
    return written


def _eval_plot(plt, evals: list[dict], path: Path) -> Path:
    """pass@1 of each column (and overall) at each evaluated step; a column measured nowhere is not drawn."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for prefix, label in (("", "overall"), ("in-space/", "in-space"), ("held-out/", "held-out"),
                          ("out-of-space/", "out-of-space"), ("custom/", "custom")):
        pts = [(r["step"], r[f"{prefix}pass@1"]) for r in evals if f"{prefix}pass@1" in r]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o", ms=4, label=label)
    ax.set_title("evaluation pass@1 (held-out tasks)")
    ax.set_xlabel("RL step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
