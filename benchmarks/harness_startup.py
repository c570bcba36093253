#!/usr/bin/env python3
"""Where a harness rollout's time goes outside its model calls, with and without the warm pool ([sandbox] warm).

    python benchmarks/harness_startup.py [--backends local,docker] [--harnesses claude-code,codex,...] [--repeats 3]
                                         [--out FILE.md]

Each rollout is `benchmarks/harnesses.py`'s scripted one (a generated ``create_word`` task; three shell tool calls
and a final answer from the scripted engine, through the real proxy), so the model costs nothing and what is left is
the sandbox and the harness. Per backend and harness, ``--repeats`` rollouts one after another, cold (``warm = 0``:
each sandbox made when its rollout comes) and warm (``warm = 1``; the pool refilled before each rollout, as it is
when it keeps up), in one run. Phases, medians (from ``RolloutTimings`` and each call's ``CallTimings``):

- ``sandbox``: queued -> harness started (cold: workspace laid out, container created and started; warm: a pooled
  sandbox checked alive, the task's files and the launch handed to it);
- ``to 1st call``: harness started -> its first request at the proxy (process start, module loading, config and
  plugins: the harness's own start-up);
- ``between calls``: the gaps between an answer sent and the next request (the tools and the harness's own work);
- ``exit``: final answer -> harness gone; ``verify``: -> scored (a verifier container of its own in Docker);
- ``outside model``: the rollout's wall time less the time the proxy held its calls (the issue's measure).

Docker needs the images (``python run.py --build-images``); the local backend needs the harness binaries
($BRIDLE_HARNESS_BIN). A harness that is missing is skipped and said so.

    python benchmarks/harness_startup.py --mix DIR [--warm 2]

End to end instead: ``configs/mix-cpu.toml`` (every harness in Docker, demonstrations, SFT, GRPO) run twice into DIR,
``[sandbox] warm = 0`` then ``--warm``, and per run the rollouts (demonstrations and RL) per minute from the first
rollout's end to the last's, with the pool's counters.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import msgspec
from _quickstart import run_logged  # benchmarks/ is sys.path[0]
from harnesses import SHELL, image_exists, scripted_proxy, table, tools_scenario  # benchmarks/ is sys.path[0]

from pipeline.messages import ModelCall, RolloutFinished, RolloutRequest
from pipeline.monitor.metrics import load_metrics
from pipeline.rollout.harnesses import HARNESSES, find_binary
from pipeline.rollout.sandbox import DockerBackend, DockerSettings, LocalBackend, LocalSettings
from pipeline.rollout.sandbox.base import SandboxBackend, SandboxCommon
from pipeline.rollout.taskgen import generate
from pipeline.rollout.tasks import Task, materialize
from pipeline.serving.scripted import Script

PHASES = ("sandbox", "to 1st call", "between calls", "exit", "verify", "outside model")


def phases(fin: RolloutFinished, calls: list[ModelCall]) -> dict[str, float]:
    t = fin.timings
    c = sorted(calls, key=lambda x: x.seq)
    assert all(x.timings for x in c)
    held = sum(x.timings.sent - x.timings.received for x in c)
    return {
        "sandbox": t.sandbox_ready - t.queued,
        "to 1st call": c[0].timings.received - t.sandbox_ready,
        "between calls": sum(c[i + 1].timings.received - c[i].timings.sent for i in range(len(c) - 1)),
        "exit": t.harness_done - c[-1].timings.sent,
        "verify": t.verified - t.harness_done,
        "outside model": t.verified - t.queued - held,
    }


def backend_for(kind: str, warm: int, tmp: Path) -> SandboxBackend:
    common = SandboxCommon(warm=warm, workdir=str(tmp / "work"))
    return LocalBackend(LocalSettings(), common) if kind == "local" else DockerBackend(DockerSettings(), common)


async def measure(kind: str, harness: str, warm: int, repeats: int, task: Task, tmp: Path) -> list[dict[str, float]]:
    path, word = msgspec.json.decode(generate("create_word", 7).solution["actions.json"])[0]["args"].values()
    sc = tools_scenario(harness, path, word)
    rids = [f"{kind}-{harness}-w{warm}-{i}" for i in range(repeats + 1)]  # the first one makes the pool's key known
    backend = backend_for(kind, warm, tmp)
    await backend.start()
    rows: list[dict[str, float]] = []
    try:
        sock = tmp / f"{kind}-{harness}-{warm}.sock"
        async with (scripted_proxy(Script(rollouts={r: sc.responses for r in rids}), sock) as (proxy, records),
                    anyio.create_task_group() as tg):
            tg.start_soon(backend.keep_warm)
            for i, rid in enumerate(rids):
                if warm and i:
                    await pool_ready(backend, warm)
                req = RolloutRequest(rollout_id=rid, group_id=rid, index=0, group_size=1, task_id=task.id,
                                     harness=harness, token=f"tok-{rid}", policy_version=0, timeout_s=300)
                proxy.register(req)
                fin = await backend.run(req, task, proxy_url=proxy.base_url, proxy_socket=str(sock))
                if fin.status != "ok":
                    raise RuntimeError(f"{kind} {harness}: rollout {fin.status}: {fin.details}")
                calls = [r for r in records if isinstance(r, ModelCall) and r.rollout_id == rid]
                if i:  # the first is a warm-up for both variants (images, payloads, page cache)
                    rows.append(phases(fin, calls))
            tg.cancel_scope.cancel()
    finally:
        await backend.aclose()
    return rows


async def pool_ready(backend: SandboxBackend, n: int) -> None:
    """Until the pool holds ``n`` ready sandboxes (it refills in the background; polled, as no event says so)."""
    assert backend.pool is not None
    with anyio.fail_after(300):
        while backend.pool.ready < n:  # noqa: ASYNC110
            await anyio.sleep(0.05)


def available(kind: str, harness: str) -> str:
    """Why ``harness`` cannot run on ``kind`` here ("" when it can)."""
    h = HARNESSES[harness]
    if kind == "local":
        return "" if not h.executable or find_binary(h.executable) else f"no {h.executable} ($BRIDLE_HARNESS_BIN)"
    return "" if h.image and anyio.run(image_exists, h.image) else f"image {h.image} not built"


def mix(out: Path, warm: int) -> str:
    """configs/mix-cpu.toml with warm = 0, then ``warm``: rollouts per minute, one row each."""
    rows = []
    for w in (0, warm):
        run_dir = out / f"mix-warm{w}"
        t0 = time.time()
        run_logged(["--experiment", "mix-cpu", "--run-dir", str(run_dir), "--no-watch"], [f"sandbox.warm={w}"],
                   out / f"mix-warm{w}.log")
        wall = time.time() - t0
        done = [r for r in load_metrics(run_dir / "metrics.jsonl") if r["kind"] in ("rollout", "demonstration")]
        span_min = (done[-1]["t"] - done[0]["t"]) / 60
        last = done[-1]
        rows.append([str(w), str(len(done)), f"{sum(r['ok'] for r in done):.0f}", f"{span_min:.1f}",
                     f"{(len(done) - 1) / span_min:.1f}" if span_min > 0 else "n/a",
                     *(f"{last.get(k, 0):.0f}" for k in ("warm_hits", "warm_misses", "warm_dead")),
                     f"{wall / 60:.1f}"])
        print(f"mix-cpu, warm {w}: {wall / 60:.1f} min", file=sys.stderr)
    return table(("warm", "rollouts", "ok", "first -> last rollout, min", "rollouts / min", "warm hits",
                  "warm misses", "warm dead", "run wall min"), rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="local,docker")
    p.add_argument("--harnesses", default=",".join(SHELL))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="", help="also write the table (markdown) to this file")
    p.add_argument("--mix", default="", metavar="DIR", help="run configs/mix-cpu.toml cold and warm into DIR")
    p.add_argument("--warm", type=int, default=2, help="--mix: the warm pool's size for the second run")
    args = p.parse_args()
    if args.mix:
        text = mix(Path(args.mix), args.warm)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return
    rows, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="bridle-startup-bench-") as d:
        tmp = Path(d)
        task = materialize(generate("create_word", 7), tmp / "task")
        for kind in args.backends.split(","):
            for harness in args.harnesses.split(","):
                why = available(kind, harness)
                if why:
                    skipped.append(f"{kind} {harness}: {why}")
                    continue
                t0 = time.time()
                for warm in (0, 1):
                    got = anyio.run(measure, kind, harness, warm, args.repeats, task, tmp)
                    med = {ph: statistics.median(r[ph] for r in got) for ph in PHASES}
                    rows.append([kind, harness, "warm" if warm else "cold", *(f"{med[ph]:.2f}" for ph in PHASES)])
                print(f"{kind} {harness}: {time.time() - t0:.0f} s", file=sys.stderr)
    when = datetime.date.today().isoformat()
    head = (f"{when}, {os.cpu_count()} cores, {args.repeats} rollouts per row (medians, seconds; 3 tool calls + a "
            "final answer from the scripted engine)")
    text = "\n".join([head, "", table(("backend", "harness", "pool", *PHASES), rows),
                      *(["", "skipped: " + "; ".join(skipped)] if skipped else [])])
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
