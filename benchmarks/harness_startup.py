#!/usr/bin/env python3
"""Where a harness rollout's time goes outside its model calls, with and without the warm pool ([sandbox] warm).

    python benchmarks/harness_startup.py [--backends local,docker] [--harnesses claude-code,codex,...] [--repeats 3]
                                         [--out FILE.md]

Each rollout is `benchmarks/harnesses.py`'s scripted one (a generated ``create_word`` task; three shell tool calls
and a final answer from the scripted engine, through the real proxy), so the model costs nothing and what is left is
the sandbox and the harness. Per backend and harness, ``--repeats`` rounds of one rollout per variant, interleaved
(a busy machine slows every variant alike), after a round that warms each up:

- ``before``: as bridle started harnesses before this benchmark existed: no warm pool, and a Node harness (Qwen Code,
  OpenClaw) compiles its code into its own compile cache under the sandbox's fresh ``/tmp``;
- ``cache`` (Docker, Node harnesses): Node's compile cache filled once in the harness's payload and read by every
  rollout (``DockerBackend.fill_compile_cache``);
- ``pool``: the same, each sandbox taken from a warm pool (``[sandbox] warm = 1``; refilled before each rollout, as
  it is when it keeps up).

Phases, medians (from ``RolloutTimings`` and each call's ``CallTimings``):

- ``sandbox``: queued -> harness started (cold: workspace laid out, container created and started; warm: a pooled
  sandbox checked alive, the task's files and the launch handed to it);
- ``to 1st call``: harness started -> its first request at the proxy (process start, module loading, config and
  plugins: the harness's own start-up);
- ``between calls``: the gaps between an answer sent and the next request (the tools and the harness's own work);
- ``exit``: final answer -> harness gone; ``verify``: -> scored (a verifier container of its own in Docker);
- ``outside model``: the rollout's wall time less the time the proxy held its calls (the issue's measure).

Docker needs the images (``python run.py --build-images``); the local backend needs the harness binaries
($BRIDLE_HARNESS_BIN). A harness that is missing is skipped and said so.

    python benchmarks/harness_startup.py --profile [--harnesses qwen-code,openclaw]

Where a Node harness's start-up goes: one rollout per harness in the local backend with V8's sampling profiler on
(``NODE_OPTIONS=--cpu-prof``: one profile per thread and per Node process), the CPU seconds of every thread up to
the harness's exit by kind: module loading (resolve, read, link), compiling (V8 parse and compile), the harness's
own code, spawning child processes, its dependencies (the three largest named), Node's other internals, garbage
collection, native (V8's "program"); a process waiting on its child (``spawnSync``) counts as idle. Claude Code (one compiled binary) and Codex (Rust) have no such hook; their phases are all there is.

    python benchmarks/harness_startup.py --mix DIR [--warm 2]

End to end instead: ``configs/mix-cpu.toml`` (every harness in Docker, demonstrations, SFT, GRPO) run twice into DIR,
``[sandbox] warm = 0`` then ``--warm``, and per run the rollouts (demonstrations and RL) per minute from the first
rollout's end to the last's, with the pool's counters.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import msgspec
from _quickstart import run_logged  # benchmarks/ is sys.path[0]
from harnesses import (  # benchmarks/ is sys.path[0]
    SHELL,
    _wrapped,
    image_exists,
    scripted_proxy,
    table,
    tools_scenario,
)

from pipeline.messages import ModelCall, RolloutFinished, RolloutRequest
from pipeline.monitor.metrics import load_metrics
from pipeline.rollout.harnesses import HARNESSES, Launch, LaunchContext, find_binary
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


def backend_for(kind: str, warm: int, workdir: Path) -> SandboxBackend:
    common = SandboxCommon(warm=warm, workdir=str(workdir))
    return LocalBackend(LocalSettings(), common) if kind == "local" else DockerBackend(DockerSettings(), common)


def variants(kind: str, harness: str) -> list[str]:
    cache = kind == "docker" and HARNESSES[harness].needs_node
    return ["before", *(["cache"] if cache else []), "pool"]


def own_cache(ctx: LaunchContext, launch: Launch) -> None:
    """The ``before`` variant: the harness's compile cache where a Node harness puts it unless told (its /tmp)."""
    launch.env["NODE_COMPILE_CACHE"] = "/tmp/node-compile-cache"


async def measure(kind: str, harness: str, repeats: int, task: Task, tmp: Path) -> dict[str, list[dict[str, float]]]:
    """Every variant's rollouts of ``harness``, interleaved round by round (one rollout of each variant per round), so
    that whatever else loads the machine meanwhile falls on all of them alike."""
    path, word = msgspec.json.decode(generate("create_word", 7).solution["actions.json"])[0]["args"].values()
    sc = tools_scenario(harness, path, word)
    names = {v: harness for v in variants(kind, harness)}
    if "cache" in names:  # "before": the harness's own compile cache in its /tmp, as before bridle filled one
        names["before"] = f"{harness}-before"
        HARNESSES[names["before"]] = _wrapped(HARNESSES[harness], own_cache, names["before"])
    backends = {v: backend_for(kind, int(v == "pool"), tmp / v) for v in names}
    rids = {v: [f"{kind}-{harness}-{v}-{i}" for i in range(repeats + 1)] for v in names}
    script = Script(rollouts={r: sc.responses for v in names for r in rids[v]})
    rows: dict[str, list[dict[str, float]]] = {v: [] for v in names}
    sock = tmp / f"{kind}-{harness}.sock"
    try:
        for b in backends.values():
            await b.start()
        async with scripted_proxy(script, sock) as (proxy, records), anyio.create_task_group() as tg:
            for b in backends.values():
                tg.start_soon(b.keep_warm)
            for i in range(repeats + 1):  # round 0 warms up every variant (images, payloads, the pool's kind)
                for v, b in backends.items():
                    if b.pool is not None and i:
                        await pool_ready(b, 1)
                    rid = rids[v][i]
                    req = RolloutRequest(rollout_id=rid, group_id=rid, index=0, group_size=1, task_id=task.id,
                                         harness=names[v], token=f"tok-{rid}", policy_version=0, timeout_s=300)
                    proxy.register(req)
                    fin = await b.run(req, task, proxy_url=proxy.base_url, proxy_socket=str(sock))
                    if fin.status != "ok":
                        raise RuntimeError(f"{kind} {harness} {v}: rollout {fin.status}: {fin.details}")
                    if i:
                        rows[v].append(phases(fin, [r for r in records
                                                    if isinstance(r, ModelCall) and r.rollout_id == rid]))
            tg.cancel_scope.cancel()
    finally:
        for b in backends.values():
            await b.aclose()
        HARNESSES.pop(f"{harness}-before", None)
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


PROFILED = ("qwen-code", "openclaw")
# V8 functions that parse and compile JavaScript (what Node's compile cache saves)
COMPILING = {"(parse)", "compileFunction", "compileSourceTextModule", "compileForInternalLoader", "wrapSafe",
             "compileFunctionForCJSLoader", "ModuleWrap"}
LOADING = re.compile(r"node:internal/modules|package_json|internalModuleStat|node:internal/url|realpath|lstat|"
                     r"readFileUtf8|statSync")


def package_of(url: str) -> str:
    """The npm package a script URL belongs to ("" for Node's own): the path after its last node_modules/."""
    rest = url.rpartition("node_modules/")[2] if "node_modules/" in url else ""
    parts = rest.split("/")
    return "/".join(parts[:2]) if rest.startswith("@") else parts[0]


def kind_of(frame: dict[str, str], own: str) -> str:
    url, fn = frame.get("url", ""), frame.get("functionName", "")
    if fn in ("(idle)", "(root)", "spawnSync"):  # spawnSync: waiting on a child, whose own profile counts
        return "idle"
    if fn == "spawn":  # fork + exec of a child, synchronous in the parent
        return "spawning processes"
    if fn == "(garbage collector)":
        return "garbage collection"
    if fn == "(program)":
        return "native (V8 program)"
    if fn in COMPILING:
        return "compiling"
    if LOADING.search(url) or LOADING.search(fn):
        return "module loading"
    pkg = package_of(url)
    if pkg == own or (url and not pkg and not url.startswith("node:")):
        return "harness code"  # its own package (or, bundled, its own files)
    return f"dep:{pkg}" if pkg else "node internals"


def cpu_profile(folder: Path, own: str) -> tuple[int, collections.Counter[str]]:
    """Seconds of samples by kind over every ``*.cpuprofile`` in ``folder``; how many threads wrote one."""
    kinds: collections.Counter[str] = collections.Counter()
    files = sorted(folder.glob("*.cpuprofile"))
    for f in files:
        prof = json.loads(f.read_text())
        frames = {n["id"]: n["callFrame"] for n in prof["nodes"]}
        for sample, delta in zip(prof["samples"], prof["timeDeltas"], strict=True):
            kinds[kind_of(frames[sample], own)] += delta / 1e6
    return len(files), kinds


async def profile_one(harness: str, task: Task, tmp: Path) -> list[str]:
    """One local rollout of ``harness`` with V8's profiler on; its row."""
    path, word = msgspec.json.decode(generate("create_word", 7).solution["actions.json"])[0]["args"].values()
    sc = tools_scenario(harness, path, word)
    out = tmp / f"cpuprof-{harness}"
    await anyio.Path(out).mkdir()
    name = f"{harness}-profiled"

    def edit(_ctx: LaunchContext, launch: Launch) -> None:
        launch.env["NODE_OPTIONS"] = f"{launch.env.get('NODE_OPTIONS', '')} --cpu-prof --cpu-prof-dir={out}".strip()

    HARNESSES[name] = _wrapped(HARNESSES[harness], edit, name)
    backend = LocalBackend(LocalSettings(), SandboxCommon(workdir=str(tmp / "profile")))
    rid = f"profile-{harness}"
    sock = tmp / f"{rid}.sock"
    try:
        await backend.start()
        async with scripted_proxy(Script(rollouts={rid: sc.responses}), sock) as (proxy, records):
            req = RolloutRequest(rollout_id=rid, group_id=rid, index=0, group_size=1, task_id=task.id, harness=name,
                                 token=f"tok-{rid}", policy_version=0, timeout_s=300)
            proxy.register(req)
            fin = await backend.run(req, task, proxy_url=proxy.base_url, proxy_socket=str(sock))
    finally:
        await backend.aclose()
        HARNESSES.pop(name, None)
    if fin.status != "ok":
        raise RuntimeError(f"local {harness} (profiled): rollout {fin.status}: {fin.details}")
    ph = phases(fin, [r for r in records if isinstance(r, ModelCall) and r.rollout_id == rid])
    own = package_of(str(await anyio.Path(find_binary(HARNESSES[harness].executable) or "").resolve()))
    threads, kinds = await anyio.to_thread.run_sync(cpu_profile, out, own)
    busy = sum(v for k, v in kinds.items() if k != "idle")
    deps = sorted(((v, k.removeprefix("dep:")) for k, v in kinds.items() if k.startswith("dep:")), reverse=True)
    cells = [f"{kinds[k]:.2f} ({kinds[k] / busy:.0%})" if busy else "n/a" for k in PROFILE_KINDS]
    dep_total = sum(v for v, _ in deps)
    return [harness, str(threads), f"{ph['to 1st call']:.2f}", f"{busy:.2f}", *cells,
            f"{dep_total:.2f} ({dep_total / busy:.0%}): " + ", ".join(f"{k} {v:.2f}" for v, k in deps[:3])
            if busy else "n/a"]


PROFILE_KINDS = ("module loading", "compiling", "harness code", "spawning processes", "node internals",
                 "garbage collection", "native (V8 program)")


def profile(harnesses: list[str]) -> str:
    rows, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="bridle-startup-profile-") as d:
        tmp = Path(d)
        task = materialize(generate("create_word", 7), tmp / "task")
        for harness in harnesses:
            why = available("local", harness) if harness in PROFILED else "not a Node harness"
            if why:
                skipped.append(f"{harness}: {why}")
                continue
            rows.append(anyio.run(profile_one, harness, task, tmp))
    head = (f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores, local backend, one rollout each (3 tool "
            "calls + a final answer); CPU seconds of every thread and process to the harness's exit, idle excluded")
    return "\n".join([head, "", table(("harness", "profiles", "to 1st call, s", "busy CPU, s", *PROFILE_KINDS,
                                        "dependencies (largest 3)"), rows),
                      *(["", "skipped: " + "; ".join(skipped)] if skipped else [])])


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
    p.add_argument("--profile", action="store_true", help="V8 CPU profiles of the Node harnesses' start-up (local)")
    args = p.parse_args()
    if args.profile:
        text = profile(args.harnesses.split(",") if args.harnesses != ",".join(SHELL) else list(PROFILED))
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return
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
                for variant, got in anyio.run(measure, kind, harness, args.repeats, task, tmp).items():
                    med = {ph: statistics.median(r[ph] for r in got) for ph in PHASES}
                    rows.append([kind, harness, variant, *(f"{med[ph]:.2f}" for ph in PHASES)])
                print(f"{kind} {harness}: {time.time() - t0:.0f} s", file=sys.stderr)
    when = datetime.date.today().isoformat()
    head = (f"{when}, {os.cpu_count()} cores, {args.repeats} rollouts per row (medians, seconds; 3 tool calls + a "
            "final answer from the scripted engine)")
    text = "\n".join([head, "", table(("backend", "harness", "variant", *PHASES), rows),
                      *(["", "skipped: " + "; ".join(skipped)] if skipped else [])])
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
