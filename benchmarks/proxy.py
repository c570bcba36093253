#!/usr/bin/env python3
"""Proxy overhead: the latency bridle's capturing proxy adds and the throughput it keeps, next to LiteLLM's proxy.

    python benchmarks/proxy.py                         # levels 1 16 64, ~300 requests per level and target
    python benchmarks/proxy.py --levels 1 64 --requests 200 --no-litellm
    python benchmarks/proxy.py --turns 8               # agent-like rollouts: 8 calls, each resending the history
    python benchmarks/proxy.py --py-spy /tmp/bridle.json # also profile the bridle proxy (pip install py-spy;
                                                       # .json = speedscope, .svg = flamegraph)
    python benchmarks/proxy.py --workers 1,2,4 --levels 64 # throughput per proxy worker count ([proxy] workers)

Set-up (every process alone on its own event loop, everything on 127.0.0.1):

- engine: ``benchmarks/_zero_engine.py``, an HTTP server that answers instantly with the ids of "OK"+<|im_end|>.
  It serves SGLang's native ``/generate`` (for bridle) and an OpenAI ``/v1/chat/completions`` that streams.
- direct: the load client calls the engine's ``/v1/chat/completions`` (stream=true) itself — the baseline. The
  engine only parses the JSON; a real engine's chat endpoint would also apply the chat template and tokenize the
  prompt, work bridle does in its place (it sends ids to ``/generate``). So there is a second baseline:
- direct+tokenize: the same call to ``/tokenize/v1/chat/completions``, where the zero engine also renders and
  tokenizes the request (Qwen3 template, bridle's tiktoken tokenizer) before answering.
- bridle: ``pipeline.serving.proxy.Proxy`` over ``pipeline.serving.sglang_client.HttpEngine`` pointed at the engine's
  ``/generate``, started by this script in its own process (``--serve-bridle``), one rollout token per client.
- LiteLLM: ``litellm --config`` forwarding model "policy" to the engine's ``/v1/chat/completions``
  (one worker, master key from ``LITELLM_MASTER_KEY``, set here to a throwaway value).
- load client: its own process (``--client``), aiohttp, N closed-loop workers, each request a streaming chat
  completion with a ~2k-token prompt (a long user message made unique per request, so nothing is cached); the
  requests and the client are in ``benchmarks/_proxy_workload.py``.

Reported per level: direct p50 and requests/s; added latency = p50 (p99) via the proxy minus p50 (p99) direct;
throughput via the proxy as a % of direct; bridle's render time (chat template + tokenization, Splicer.render) per
call as the proxy measured it (``Proxy.render_seconds`` / calls); the direct+tokenize baseline and bridle's share of
it. Goals: <= 1 ms p50 added at one client not counting rendering, >= 40 % of direct throughput at 64 clients,
judged against the plain baseline and also reported against direct+tokenize. A throughput model checks what the
machine allows at 16+ clients: a path whose processes (client, engine, proxy: one event loop each) spend CPU
c_i per request serves at most min(cores / sum c_i, 1 / max c_i) requests/s; it reproduces the measured rates, and
with the proxy's CPU replaced by bridle's render time it gives the ceiling for any proxy that must send token
ids, here and with a core per process. Two more targets, served by bridle's process on its event loop, give the
floor under it (``serve_floor``): the same HTTP server and engine client doing only a call's I/O (``io``), and
that plus the JSON, conversion and render (``io_render``): what a proxy on this I/O keeps of the ceiling with
capture for free. Another table says where the time goes: CPU seconds per request of each
server process and of bridle's event loop alone (from /proc, so it holds on a busy machine where wall-clock
numbers swing) and bridle's per-call phases from ``ModelCall.timings``. ``--render-thread-chars`` sets bridle's
``ProxySettings.render_thread_chars`` (1: tokenize every call in a worker thread, 0: never). Wall-clock numbers
need a quiet machine with a core per process; on a shared 2-core box compare the CPU columns.

LiteLLM is a benchmark-only dependency and is not in pyproject.toml. Installing ``litellm[proxy]`` into bridle's
environment changes the versions of installed packages (huggingface-hub, rich, python-dateutil), so install it in
a venv of its own and point ``--litellm`` at its binary (the default looks in /work/venv-litellm, then PATH)::

    python3 -m venv /work/venv-litellm && /work/venv-litellm/bin/pip install 'litellm[proxy]'

Without it the LiteLLM columns show "-" and a message says why.

``--workers 1,2,4`` measures bridle alone, once per worker count: 1 is the in-process proxy (as above), N > 1 is
``pipeline.serving.proxy_workers.ProxyWorkers`` (N worker processes and the relay that passes their records on, as
the proxy actor runs them), each client on a rollout of its own, called at the worker that owns it. Reported per
count and level: requests/s, p50, the CPU per request of the client, the engine, the relay's loop and the workers'
loops, and the throughput model's bound here and with a core per process (min(N / worker ms, 1 / relay ms) for
the proxy alone): on a 2-core machine the client and the engine take most of the cores, so only the model says
what more workers buy on a bigger node.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# benchmarks/ is sys.path[0] when run as a script
from _children import Child, free_port, main_thread_cpu_seconds, tree_cpu_seconds
from _proxy_report import print_overhead, print_throughput_model, verdicts
from _proxy_workload import MODEL, build_prompt, chat_body, offline_render_ms, run_client

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve()
LITELLM_DEFAULT = Path("/work/venv-litellm/bin/litellm")
FLOOR_TARGETS = ("io", "io_render")  # served by bridle's process on its event loop (serve_floor)
LOOP_TARGETS = ("bridle", *FLOOR_TARGETS)  # targets whose loop thread's CPU is read

def client_main(args: argparse.Namespace) -> None:
    url, token_file, prompt_file = args.client
    tokens = json.loads(Path(token_file).read_text()) if token_file != "-" else []
    prompt = Path(prompt_file).read_text()
    res = asyncio.run(run_client(url, tokens, args.concurrency, args.requests, args.warmup, prompt, args.tag,
                                 args.max_tokens, args.turns))
    print("CLIENT-RESULT " + json.dumps(res), flush=True)


# ------------------------------------------------------------------------------------- bridle proxy side
async def serve_bridle(port: int, engine_url: str, rollouts: int, render_thread_chars: int | None) -> None:
    import anyio

    from pipeline.core.logs import configure
    from pipeline.messages import ModelCall
    from pipeline.serving.proxy import Proxy, ProxySettings
    from pipeline.serving.sglang_client import HttpEngine
    from pipeline.tokens.render import qwen3_renderer

    configure(level="info")  # what a run uses; per-call logs are debug
    # per-call phases from ModelCall.timings: before the engine (auth, JSON, conversion, render, stream head),
    # the engine call as the proxy waits for it, after it (parse, answer, write)
    stats = {"calls": 0, "pre_s": 0.0, "engine_s": 0.0, "post_s": 0.0}

    async def emit(m: Any) -> None:
        if isinstance(m, ModelCall):
            t = m.timings
            stats["calls"] += 1
            stats["pre_s"] += t.engine_start - t.received
            stats["engine_s"] += t.engine_end - t.engine_start
            stats["post_s"] += t.sent - t.engine_end

    engine = HttpEngine(engine_url, timeout_s=60.0)
    settings = ProxySettings(port=port)
    if render_thread_chars is not None:
        settings.render_thread_chars = render_thread_chars
    proxy = Proxy(engine, qwen3_renderer(), emit, settings)
    await proxy.start()
    tokens = [proxy.open_rollout(f"bench-{i}") for i in range(rollouts)]
    floor = await serve_floor(engine, proxy.renderer)
    print("BRIDLE-READY " + json.dumps({"base_url": proxy.base_url, "tokens": tokens, "pid": os.getpid(),
                                        "floor_url": floor[0]}), flush=True)
    try:
        while True:  # commands from the parent on stdin; EOF ends the server
            line = (await anyio.to_thread.run_sync(sys.stdin.readline)).strip()
            if not line or line == "quit":
                break
            if line == "stats":
                print("BRIDLE-STATS " + json.dumps({**stats, "render_seconds": proxy.render_seconds}), flush=True)
    finally:
        await floor[1].close()
        await proxy.stop()
        await engine.aclose()


async def serve_floor(engine: Any, renderer: Any) -> tuple[str, Any]:
    """The floor under the bridle proxy, in its process and on its event loop: :func:`floor_routes` on bridle's HTTP
    server. (base URL, server)."""
    from pipeline.serving.http_server import HttpServer

    server = HttpServer(floor_routes(engine, renderer), max_body_bytes=64 << 20)
    port = await server.listen_tcp("127.0.0.1", 0)
    return f"http://127.0.0.1:{port}", server


def floor_routes(engine: Any, renderer: Any) -> dict[tuple[str, str], Any]:
    """The handlers of the floor: the same engine client doing only the I/O of a call (``/io``: the body is read, not
    parsed; fixed prompt ids go to the engine; a fixed three-event stream comes back in one write), and that plus
    the JSON, the conversion and the render (``/io_render``). Nothing is recorded, authenticated or spliced."""
    import numpy as np
    import orjson

    from pipeline.serving.engine import EngineSampling
    from pipeline.serving.http_server import Response
    from pipeline.tokens.from_wire import from_chat

    sampling = EngineSampling(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=16, stop_token_ids=(151645,),
                              seed=None)
    chunk = (b'data: {"id":"chatcmpl-floor","object":"chat.completion.chunk","model":"policy","choices":[{"index":0,'
             b'"delta":{"content":"OK"},"finish_reason":null}]}\n\n')
    answer = chunk + chunk.replace(b'"content":"OK"', b'"content":""') + b"data: [DONE]\n\n"
    fixed: list[Any] = []  # the first request's ids: what /io sends every time

    async def call(request: Any, ids: Any) -> Any:
        await engine.generate(ids, sampling, rid=os.urandom(8).hex())
        return Response(200, answer, content_type="text/event-stream")  # the whole stream in one write

    async def io(request: Any) -> Any:
        if not fixed:
            fixed.append(np.asarray(renderer.render_ids(from_chat(json.loads(request.body))), dtype=np.int32))
        return await call(request, fixed[0])

    async def io_render(request: Any) -> Any:
        return await call(request, renderer.render_ids(from_chat(orjson.loads(request.body))))

    return {("POST", "/io/v1/chat/completions"): io, ("POST", "/io_render/v1/chat/completions"): io_render}


@contextlib.contextmanager
def bench_folder(prefix: str, prompt: str) -> Iterator[tuple[Path, Path, list[Child]]]:
    """A work folder holding the prompt, and the children started into it: stopped on exit; the folder is removed
    after a success and kept (with the children's logs) after a failure."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    prompt_file = tmp / "prompt.txt"
    prompt_file.write_text(prompt)
    children: list[Child] = []
    try:
        yield tmp, prompt_file, children
    except BaseException:
        print(f"benchmark failed; child logs kept in {tmp}", file=sys.stderr)
        raise
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    finally:
        for c in reversed(children):
            c.stop()


async def serve_workers(n: int, engine_url: str, rollouts: int) -> None:
    """N proxy workers as the proxy actor runs them (no actor: the records are counted here, the relay's work)."""
    import anyio

    from pipeline.core.logs import configure
    from pipeline.messages import ModelCall, RolloutRequest
    from pipeline.serving.factory import EngineSettings
    from pipeline.serving.proxy import ProxySettings
    from pipeline.serving.proxy_workers import ProxyWorkers, Setup

    configure(level="info")
    stats = {"calls": 0}

    async def emit(m: Any) -> None:
        stats["calls"] += isinstance(m, ModelCall)

    tmp = tempfile.mkdtemp(prefix="bridle-pw-bench-")
    settings = ProxySettings()  # TCP only, like the in-process proxy here
    setup = Setup(proxy=settings, renderer=EngineSettings(), engine_url=engine_url, control_urls=[engine_url],
                  generate_timeout_s=60.0, policy_version=0)
    pool = ProxyWorkers(n, settings, setup, emit, control_dir=tmp, log_dir=Path(tmp))
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(pool.run)
            targets = []
            for i in range(rollouts):
                req = RolloutRequest(rollout_id=f"bench-{i}", group_id=f"bench-{i}", index=0, group_size=1, task_id="",
                                     harness="manual", token=f"bridle-bench-{i}", policy_version=0)
                routed = await pool.register(req)
                assert routed.proxy is not None
                targets.append([routed.proxy.base_url + "/v1/chat/completions", req.token])
            print("BRIDLE-READY " + json.dumps({"targets": targets, "pid": os.getpid()}), flush=True)
            while True:  # EOF on stdin ends the server
                line = (await anyio.to_thread.run_sync(sys.stdin.readline)).strip()
                if not line or line == "quit":
                    break
            tg.cancel_scope.cancel()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def serve_bridle_main(args: argparse.Namespace) -> None:
    from pipeline.core.runtime import run_main

    port, engine_url = args.serve_bridle
    run_main(serve_bridle, int(port), engine_url, args.rollouts, args.render_thread_chars)


# ------------------------------------------------------------------------------------------ orchestration
def find_litellm(arg: str | None) -> tuple[str | None, str]:
    """(binary, why not) for the LiteLLM proxy."""
    if arg == "none":
        return None, "skipped (--no-litellm)"
    for cand in ([arg] if arg else [str(LITELLM_DEFAULT), shutil.which("litellm") or ""]):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand, ""
    return None, ("litellm not installed: python3 -m venv /work/venv-litellm && "
                  "/work/venv-litellm/bin/pip install 'litellm[proxy]'  (or pass --litellm PATH)")


def start_litellm(binary: str, engine_url: str, tmp: Path) -> tuple[Child, str, str]:
    port = free_port()
    key = "sk-bridle-bench"
    cfg = tmp / "litellm.yaml"
    cfg.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: {engine_url}/v1\n"
        "      api_key: sk-zero\n"
        "litellm_settings:\n"
        "  drop_params: true\n"
        "  telemetry: false\n"
        "general_settings:\n"
        "  master_key: os.environ/LITELLM_MASTER_KEY\n"
    )
    env = {"LITELLM_MASTER_KEY": key, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR",
           "LITELLM_TELEMETRY": "False", "DISABLE_ADMIN_UI": "True", "NO_DOCS": "True", "PYTHONUNBUFFERED": "1"}
    child = Child("litellm", [binary, "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port),
                              "--num_workers", "1"], env=env, log_dir=tmp)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    import urllib.request

    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise RuntimeError(f"litellm exited with {child.proc.returncode}; see {child.log_path}")
        try:
            with urllib.request.urlopen(url + "/health/liveliness", timeout=2) as r:
                if r.status == 200:
                    return child, url, key
        except OSError:
            pass
        time.sleep(0.5)
    child.stop()
    raise RuntimeError(f"litellm did not answer /health/liveliness within 180 s; see {child.log_path}")


def run_level(url: str, token_file: str, prompt_file: Path, concurrency: int, requests: int, tag: str,
              max_tokens: int, turns: int) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE), "--client", url, token_file, str(prompt_file),
           "--concurrency", str(concurrency), "--requests", str(requests), "--turns", str(turns),
           "--warmup", str(warmup_requests(concurrency, turns)), "--tag", tag, "--max-tokens", str(max_tokens)]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    for line in out.stdout.splitlines():
        if line.startswith("CLIENT-RESULT "):
            return json.loads(line[len("CLIENT-RESULT "):])
    raise RuntimeError(f"client for {url} failed (exit {out.returncode}): {out.stderr[-2000:]}")


def warmup_requests(concurrency: int, turns: int) -> int:
    """Untimed requests before a level's timed ones: whole conversations, at least two per client."""
    return max(2 * concurrency, 8) * turns


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def describe_workload(prompt: str, n_prompt: int, turns: int) -> str:
    if turns == 1:
        return f"{n_prompt}-token prompts"
    from pipeline.tokens.from_wire import from_chat
    from pipeline.tokens.render import qwen3_renderer

    n_last = len(qwen3_renderer().render_ids(from_chat(chat_body(prompt, "0-x-0-0", 16, turns - 1))))
    return (f"conversations of {turns} calls, prompts of {n_prompt}-{n_last} tokens (each call resends "
            "the history plus a short message)")


@dataclass
class Servers:
    """The running servers and the targets the load client calls: name -> (URL, tokens JSON file or "-")."""

    engine: Child
    engine_url: str
    bridle: Child
    bridle_ready: dict[str, Any]  # BRIDLE-READY: base_url, tokens, pid
    targets: dict[str, tuple[str, str]]
    procs: dict[str, Child]  # the server processes whose CPU is measured, by target name (and "engine")

    def bridle_stats(self) -> dict[str, float]:
        self.bridle.send("stats")
        return json.loads(self.bridle.wait_line("BRIDLE-STATS ", 30))

    def cpu_seconds(self) -> dict[str, float]:
        return {k: tree_cpu_seconds(c.proc.pid) for k, c in self.procs.items()}


def start_servers(args: argparse.Namespace, ids: list[int], litellm_bin: str | None, tmp: Path,
                  children: list[Child]) -> tuple[Servers, str]:
    """Start the zero engine, bridle's proxy and (with ``litellm_bin``) LiteLLM's, appending each to ``children``
    as it starts (the caller stops them); (servers, why LiteLLM failed to start or "")."""
    engine = Child("engine", [sys.executable, str(ROOT / "benchmarks" / "_zero_engine.py"),
                              "--ids", *map(str, ids), "--text", "OK", "--tokenize"], log_dir=tmp)
    children.append(engine)
    engine_url = engine.wait_line("ENGINE-READY ", 60)

    serve_cmd = [sys.executable, str(HERE), "--serve-bridle", "0", engine_url, "--rollouts", str(max(args.levels))]
    if args.render_thread_chars is not None:
        serve_cmd += ["--render-thread-chars", str(args.render_thread_chars)]
    if args.py_spy:
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        fmt = {".json": "speedscope", ".txt": "raw"}.get(Path(args.py_spy).suffix, "flamegraph")
        serve_cmd = [spy, "record", "--nonblocking", "--rate", "1000", "-o", args.py_spy, "--format", fmt, "--",
                     *serve_cmd]
    bridle = Child("bridle", serve_cmd, stdin=True, log_dir=tmp)
    children.append(bridle)
    ready = json.loads(bridle.wait_line("BRIDLE-READY ", 120))
    bridle_tokens = tmp / "bridle_tokens.json"
    bridle_tokens.write_text(json.dumps(ready["tokens"]))

    targets: dict[str, tuple[str, str]] = {
        "direct": (engine_url + "/v1/chat/completions", "-"),
        "direct_tok": (engine_url + "/tokenize/v1/chat/completions", "-"),
        "bridle": (ready["base_url"] + "/v1/chat/completions", str(bridle_tokens)),
        # the floor under bridle (serve_floor), in bridle's process
        **{t: (f"{ready['floor_url']}/{t}/v1/chat/completions", "-") for t in FLOOR_TARGETS},
    }
    procs = {"engine": engine, "bridle": bridle, **{t: bridle for t in FLOOR_TARGETS}}
    litellm_failed = ""
    if litellm_bin:
        try:
            lchild, lurl, key = start_litellm(litellm_bin, engine_url, tmp)
            children.append(lchild)
            (tmp / "litellm_tokens.json").write_text(json.dumps([key]))
            targets["litellm"] = (lurl + "/v1/chat/completions", str(tmp / "litellm_tokens.json"))
            procs["litellm"] = lchild
        except RuntimeError as e:
            litellm_failed = f"LiteLLM proxy failed to start: {e}"
    return Servers(engine, engine_url, bridle, ready, targets, procs), litellm_failed


class LevelTally:
    """One level's measurements, summed over its rounds: per target the latencies, wall time and errors; CPU
    seconds per consumer ("engine:<target>", "client:<target>", a proxy by its target name, "bridle loop") with
    the requests they served; bridle's per-call phase seconds."""

    def __init__(self, level: int, servers: Servers) -> None:
        targets = servers.targets
        self.level = level
        self.pooled: dict[str, dict[str, Any]] = {t: {"lat": [], "wall": 0.0, "n": 0, "errors": 0} for t in targets}
        self.cpu: dict[str, float] = {k: 0.0 for k in [*servers.procs, *("engine:" + t for t in targets),
                                                       *("client:" + t for t in targets), "bridle loop"]
                                      if k != "engine"}
        self.cpu.update({f"{t} loop": 0.0 for t in FLOOR_TARGETS})
        self.cpu_n: dict[str, int] = {k: 0 for k in self.cpu}
        self.phases = {"render_seconds": 0.0, "calls": 0, "pre_s": 0.0, "engine_s": 0.0, "post_s": 0.0}

    def add_cpu(self, key: str, seconds: float, requests: int) -> None:
        self.cpu[key] += seconds
        self.cpu_n[key] += requests

    def add_phases(self, before: dict[str, float], after: dict[str, float]) -> None:
        for k in self.phases:
            self.phases[k] += after[k] - before[k]

    def add_result(self, target: str, r: dict[str, Any]) -> None:
        p = self.pooled[target]
        p["lat"] += r["latencies"]
        p["wall"] += r["wall"]
        p["n"] += len(r["latencies"])
        p["errors"] += r["errors"]

    def row(self) -> dict[str, Any]:
        cpu, cpu_n = self.cpu, self.cpu_n
        row: dict[str, Any] = {"level": self.level,
                               "cpu_ms": {k: 1e3 * cpu[k] / cpu_n[k] if cpu_n[k] else float("nan") for k in cpu}}
        for t, p in self.pooled.items():
            row[t] = {"p50": pct(p["lat"], 50) * 1e3, "p99": pct(p["lat"], 99) * 1e3,
                      "rps": p["n"] / p["wall"] if p["wall"] else float("nan"), "n": p["n"], "errors": p["errors"]}
        c = self.phases["calls"] or float("nan")
        row["render_ms"] = self.phases["render_seconds"] / c * 1e3
        row["phases_ms"] = {k: self.phases[k] / c * 1e3 for k in ("pre_s", "engine_s", "post_s")}
        return row


def measure_target(args: argparse.Namespace, servers: Servers, prompt_file: Path, tally: LevelTally, target: str,
                   requests: int, rnd: int) -> None:
    """One client run of ``requests`` against ``target``, with the CPU the servers spent on it."""
    level, procs, pid = tally.level, servers.procs, servers.bridle_ready["pid"]
    url, tok = servers.targets[target]
    if target == "bridle":
        before = servers.bridle_stats()
    cpu0 = servers.cpu_seconds()
    loop0 = main_thread_cpu_seconds(pid) if target in LOOP_TARGETS else 0.0
    r = run_level(url, tok, prompt_file, level, requests, f"{level}-{target}-{rnd}", args.max_tokens, args.turns)
    cpu1 = servers.cpu_seconds()
    done = r["errors"] + len(r["latencies"]) + warmup_requests(level, args.turns)  # warm-up counts
    if target in LOOP_TARGETS:
        tally.add_cpu(f"{target} loop", main_thread_cpu_seconds(pid) - loop0, done)
    # CPU per request of the server in the path: the proxy for bridle/LiteLLM, the engine always
    if target in procs:
        tally.add_cpu(target, cpu1[target] - cpu0[target], done)
    tally.add_cpu("engine:" + target, cpu1["engine"] - cpu0["engine"], done)
    tally.add_cpu("client:" + target, r["cpu"], len(r["latencies"]))
    if target == "bridle":
        tally.add_phases(before, servers.bridle_stats())
    tally.add_result(target, r)
    if r["errors"]:
        print(f"  {target} @ {level}: {r['errors']} errors, e.g. {r['first_errors'][:2]}", flush=True)


def measure_level(args: argparse.Namespace, servers: Servers, prompt_file: Path, level: int) -> dict[str, Any]:
    """A level's table row: ``args.rounds`` rounds over every target, in alternating order (spreads drift)."""
    n = max(args.requests, 4 * level)
    per_round = max(level, n // args.rounds)
    tally = LevelTally(level, servers)
    for rnd in range(args.rounds):
        order = list(servers.targets) if rnd % 2 == 0 else list(reversed(servers.targets))
        for t in order:
            measure_target(args, servers, prompt_file, tally, t, per_round, rnd)
    row = tally.row()
    print(f"  level {level}: " + ", ".join(
        f"{t} p50 {row[t]['p50']:.2f} ms p99 {row[t]['p99']:.2f} ms {row[t]['rps']:.0f} req/s"
        for t in tally.pooled), flush=True)
    return row


def bench(args: argparse.Namespace) -> int:
    from pipeline.tokens.tokenizer import QwenTokenizer

    ids = QwenTokenizer().encode("OK<|im_end|>")
    prompt, n_prompt = build_prompt(args.prompt_tokens)
    workload = describe_workload(prompt, n_prompt, args.turns)
    render_offline = offline_render_ms(prompt)
    litellm_bin, litellm_why = find_litellm("none" if args.no_litellm else args.litellm)

    with bench_folder("bridle-proxy-bench-", prompt) as (tmp, prompt_file, children):
        servers, litellm_failed = start_servers(args, ids, litellm_bin, tmp, children)
        litellm_why = litellm_failed or litellm_why
        targets = servers.targets
        print(f"prompt: {n_prompt} tokens rendered; answer ids {ids}; engine {servers.engine_url}; "
              f"bridle {servers.bridle_ready['base_url']}; LiteLLM {targets['litellm'][0] if 'litellm' in targets else litellm_why}",
              flush=True)
        rows = [measure_level(args, servers, prompt_file, level) for level in args.levels]

    print_overhead(rows, workload, render_offline, None if "litellm" in targets else litellm_why)
    print_throughput_model(rows, render_offline)
    for v in verdicts(rows):
        print(v)
    if args.json:
        Path(args.json).write_text(json.dumps({"prompt_tokens": n_prompt, "turns": args.turns, "render_offline_ms": render_offline,
                                               "rows": rows}, indent=1))
    errors = sum(r[t]["errors"] for r in rows for t in targets if t in r)
    return 1 if errors else 0


def bench_workers(args: argparse.Namespace) -> int:
    """Throughput per proxy worker count (``--workers``); see the module docstring."""
    from _children import _proc_stat
    from _proxy_report import cores, fmt, print_table

    from pipeline.tokens.tokenizer import QwenTokenizer

    counts = [int(x) for x in args.workers.split(",")]
    ids = QwenTokenizer().encode("OK<|im_end|>")
    prompt, n_prompt = build_prompt(args.prompt_tokens)
    rows: list[dict[str, Any]] = []
    with bench_folder("bridle-proxy-workers-bench-", prompt) as (tmp, prompt_file, children):
        engine = Child("engine", [sys.executable, str(ROOT / "benchmarks" / "_zero_engine.py"),
                                  "--ids", *map(str, ids), "--text", "OK"], log_dir=tmp)
        children.append(engine)
        engine_url = engine.wait_line("ENGINE-READY ", 60)
        for n in counts:
            serve = ["--serve-bridle", "0", engine_url] if n == 1 else ["--serve-workers", str(n), engine_url]
            child = Child(f"proxy-{n}", [sys.executable, str(HERE), *serve, "--rollouts", str(max(args.levels))],
                          stdin=True, log_dir=tmp)
            children.append(child)
            ready = json.loads(child.wait_line("BRIDLE-READY ", 180))
            targets = ready.get("targets") or [[ready["base_url"] + "/v1/chat/completions", t] for t in ready["tokens"]]
            (tmp / f"targets-{n}.json").write_text(json.dumps(targets))
            pid = child.proc.pid
            for level in args.levels:
                requests = max(args.requests, 4 * level)
                own0 = (_proc_stat(f"/proc/{pid}/stat") or (0, float("nan")))[1]
                tree0, loop0, eng0 = tree_cpu_seconds(pid), main_thread_cpu_seconds(pid), tree_cpu_seconds(engine.proc.pid)
                r = run_level(targets[0][0], str(tmp / f"targets-{n}.json"), prompt_file, level, requests,
                              f"w{n}-{level}", args.max_tokens, args.turns)
                own1 = (_proc_stat(f"/proc/{pid}/stat") or (0, float("nan")))[1]
                tree1, loop1, eng1 = tree_cpu_seconds(pid), main_thread_cpu_seconds(pid), tree_cpu_seconds(engine.proc.pid)
                done = r["errors"] + len(r["latencies"]) + warmup_requests(level, args.turns)
                ms = 1e3 / done
                # one worker: the in-process proxy is the only loop; N: the relay is this child's loop, the
                # workers are its children (their tokenizer threads included)
                worker_ms = (tree1 - tree0) * ms if n == 1 else ((tree1 - tree0) - (own1 - own0)) * ms
                relay_ms = 0.0 if n == 1 else (loop1 - loop0) * ms
                row = {"workers": n, "level": level, "rps": len(r["latencies"]) / r["wall"] if r["wall"] else 0.0,
                       "p50": pct(r["latencies"], 50) * 1e3, "errors": r["errors"],
                       "cpu_ms": {"client": r["cpu"] * 1e3 / max(1, len(r["latencies"])), "engine": (eng1 - eng0) * ms,
                                  "relay": relay_ms, "workers": worker_ms, "proxy": (tree1 - tree0) * ms}}
                c = row["cpu_ms"]
                loops = [c["client"], c["engine"], *([relay_ms] if n > 1 else []), *[worker_ms / n] * n]
                row["model_here"] = 1e3 * min(cores() / (c["client"] + c["engine"] + c["proxy"]), 1 / max(loops))
                # a loop below the CPU clock's 10 ms tick over the whole level reads 0: no bound from it
                row["proxy_core_each"] = 1e3 * min(n / worker_ms if worker_ms else float("inf"),
                                                   1 / relay_ms if relay_ms else float("inf"))
                rows.append(row)
                print(f"  workers {n} @ {level}: {row['rps']:.0f} req/s, p50 {row['p50']:.2f} ms, "
                      f"errors {r['errors']}", flush=True)
            child.stop()
            children.remove(child)
    print()
    print(f"Proxy workers, {n_prompt}-token prompts, {cores()} cores. CPU ms per request: client, engine, the relay "
          "(the actor's loop passing records on) and the workers (all of them together; each request is served by "
          "one). Model: min(cores / all, 1 / busiest loop) here; the proxy alone with a core per process: "
          "min(workers / worker ms, 1 / relay ms).")
    head = ["workers", "clients", "req/s", "p50 ms", "client", "engine", "relay", "workers", "model req/s here",
            "proxy, a core each"]
    print_table(head, [[str(r["workers"]), str(r["level"]), fmt(r["rps"], 0), fmt(r["p50"], 2),
                        *(fmt(r["cpu_ms"][k], 3) for k in ("client", "engine", "relay", "workers")),
                        fmt(r["model_here"], 0), fmt(r["proxy_core_each"], 0)] for r in rows])
    if args.json:
        Path(args.json).write_text(json.dumps({"prompt_tokens": n_prompt, "cores": cores(), "rows": rows}, indent=1))
    return 1 if any(r["errors"] for r in rows) else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 16, 64], help="concurrent streaming clients")
    ap.add_argument("--requests", type=int, default=300, help="timed requests per level and target")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per level (spreads machine noise)")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--turns", type=int, default=1,
                    help="calls per conversation: 1 = every request a fresh 2k-token prompt (the worst case for "
                    "bridle, which then tokenizes all of it); T > 1 = agent-like rollouts whose calls resend the "
                    "history plus a short new message")
    ap.add_argument("--litellm", help=f"LiteLLM binary (default {LITELLM_DEFAULT}, then PATH)")
    ap.add_argument("--no-litellm", action="store_true")
    ap.add_argument("--py-spy", metavar="OUT", help="record the bridle proxy with py-spy (.svg flamegraph, "
                    ".json speedscope, .txt collapsed stacks)")
    ap.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    ap.add_argument("--workers", metavar="N,N,...", help="bridle alone, once per proxy worker count (1: in process)")
    ap.add_argument("--render-thread-chars", type=int, metavar="N",
                    help="bridle's ProxySettings.render_thread_chars (0: always tokenize on the event loop)")
    # internal entry points (the children this script starts)
    ap.add_argument("--serve-bridle", nargs=2, metavar=("PORT", "ENGINE_URL"), help=argparse.SUPPRESS)
    ap.add_argument("--serve-workers", nargs=2, metavar=("N", "ENGINE_URL"), help=argparse.SUPPRESS)
    ap.add_argument("--rollouts", type=int, default=64, help=argparse.SUPPRESS)
    ap.add_argument("--client", nargs=3, metavar=("URL", "TOKENS_JSON", "PROMPT_FILE"), help=argparse.SUPPRESS)
    ap.add_argument("--concurrency", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="x", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_bridle:
        serve_bridle_main(args)
    elif args.serve_workers:
        from pipeline.core.runtime import run_main

        run_main(serve_workers, int(args.serve_workers[0]), args.serve_workers[1], args.rollouts)
    elif args.workers:
        sys.exit(bench_workers(args))
    elif args.client:
        client_main(args)
    else:
        sys.exit(bench(args))


if __name__ == "__main__":
    main()
