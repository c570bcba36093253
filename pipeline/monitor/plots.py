"""PNG plots of a run's metrics.jsonl: reward, pass rate, entropy, throughput (matplotlib, headless)."""

from __future__ import annotations

import json
from pathlib import Path


def load_metrics(path: Path) -> list[dict]:
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a crash
    return rows


def write_plots(metrics_path: Path, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load_metrics(metrics_path)
    rl = [r for r in rows if str(r.get("source", "")).endswith(".rl")]
    sft = [r for r in rows if str(r.get("source", "")).endswith(".sft")]
    panels = [
        ("reward", "reward (mean over the step's rollouts)", rl),
        ("pass_rate", "pass rate", rl),
        ("entropy", "entropy (nats/token)", rl),
        ("tokens_per_s", "learner throughput (tokens/s)", rl),
    ]
    written = []
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (key, title, src) in zip(axes.flat, panels):
        pts = [(r["step"], r[key]) for r in src if key in r]
        if pts:
            xs, ys = zip(*pts)
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
    return written
