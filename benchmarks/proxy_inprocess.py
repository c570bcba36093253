#!/usr/bin/env python3
"""The proxy's own CPU per call, without sockets: bridle's handler next to the capture-free floor, in one process.

    python benchmarks/proxy_inprocess.py                    # 3 rounds of 3,000 calls per target, 64 in flight
    python benchmarks/proxy_inprocess.py --calls 500 --rounds 1
    python benchmarks/proxy_inprocess.py --render-thread-chars 1   # bridle tokenizes every call in a worker thread

``benchmarks/proxy.py`` measures the proxy as deployed (its own process, TCP to a load client and an engine), where
the CPU a process gets per call swings by ±15 % with the machine's load and the sockets' system calls take their
share. This script takes both out, to see what the Python of a call costs: each target is bridle's HTTP server
protocol fed whole requests on 64 connections whose transport only counts the bytes written, and an engine that
answers at once in-process ("OK" + <|im_end|>, as the zero engine). Targets, alternated round by round:

- bridle: :class:`pipeline.serving.proxy.Proxy` (authentication, conversion, labels, the splicer's render, the
  engine call, the answer, the ModelCall record), one rollout per connection;
- floor: ``benchmarks/proxy.py``'s ``/io_render`` handler on the same server: the JSON, the conversion and the render,
  the engine call and a fixed answer, nothing recorded or spliced.

Reported per target (medians over rounds): the event loop's CPU per call and that of the other threads (bridle's
render threads with ``--render-thread-chars``, else none), bridle's render time per call (``Proxy.render_seconds``;
in threads, their wall time), writes per call (a stream whose head went out early takes two),
the cyclic garbage collector's passes per 1,000 calls and its time per call (``gc.callbacks``), and after the
rounds the objects per call that only the cyclic collector could free (``gc.DEBUG_SAVEALL``: 0 means every
call's objects die by reference counting, as soon as the call ends). "capture" is bridle's CPU minus the floor's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from typing import Any

# benchmarks/ is sys.path[0] when run as a script
from _proxy_workload import build_prompt, chat_body
from proxy import floor_routes

from pipeline.core.runtime import event_loop_name, run_main
from pipeline.serving.engine import GenerateResult
from pipeline.serving.http_server import HttpServer, _Connection
from pipeline.serving.proxy import Proxy, ProxySettings
from pipeline.tokens.render import qwen3_renderer

OUTPUT_IDS = [3925, 151645]  # "OK" <|im_end|>, what benchmarks/_zero_engine.py answers


class InstantEngine:
    """Answers every generate at once, in-process."""

    async def generate(self, input_ids: Any, sampling: Any, *, rid: str | None = None) -> GenerateResult:
        return GenerateResult(rid=rid or "", output_ids=list(OUTPUT_IDS), logprobs=[-0.01] * len(OUTPUT_IDS),
                              finish_reason="stop", matched_stop=OUTPUT_IDS[-1], weight_version="0",
                              prompt_tokens=len(input_ids), completion_tokens=len(OUTPUT_IDS))

    async def abort(self, rid: str | None = None) -> None:
        return None


class CountingTransport:
    """A transport that keeps nothing: it counts the writes the server makes, the answers they start and the answers
    that are not a 200 (the first bytes of each: the status line)."""

    def __init__(self) -> None:
        self.writes = 0
        self.answers = 0
        self.failed: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes += 1
        if data.startswith(b"HTTP/1.1 "):
            self.answers += 1
            if not data.startswith(b"HTTP/1.1 200"):
                self.failed.append(data[:300])

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def request_bytes(body: dict[str, Any], path: str, token: str) -> bytes:
    raw = json.dumps(body).encode()
    return (b"POST %s HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), token.encode(), len(raw), raw))


class GcMeter:
    """The cyclic collector's passes and time while ``on`` is set."""

    def __init__(self) -> None:
        self.on = False
        self.passes = 0
        self.seconds = 0.0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if not self.on:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.passes += 1
            self.seconds += time.perf_counter() - self._t0


class Target:
    def __init__(self, name: str, server: HttpServer, path: str, tokens: list[str], proxy: Proxy | None) -> None:
        self.name, self.path, self.proxy = name, path, proxy
        self.sent = 0
        self.conns: list[_Connection] = []
        for _ in tokens:
            c = _Connection(server)
            c.connection_made(CountingTransport())  # type: ignore[arg-type]
            self.conns.append(c)

    async def run(self, requests: list[list[bytes]]) -> None:
        """Each batch: one request on every connection, then wait for all of their answers."""
        for batch in requests:
            for conn, req in zip(self.conns, batch, strict=True):
                conn.data_received(req)
            self.sent += len(batch)
            await asyncio.wait([c.task for c in self.conns if c.task is not None])

    def writes(self) -> int:
        return sum(c.transport.writes for c in self.conns)  # type: ignore[union-attr]

    def check_answers(self) -> None:
        """Every call answered with a 200, or the numbers mean nothing: stop, showing an answer that failed."""
        expected = self.sent
        answers = sum(c.transport.answers for c in self.conns)  # type: ignore[union-attr]
        failed = [f for c in self.conns for f in c.transport.failed]  # type: ignore[union-attr]
        if answers != expected or failed:
            raise SystemExit(f"{self.name}: {answers} answers to {expected} calls, {len(failed)} not 200"
                             + (f"; the first: {failed[0]!r}" if failed else ""))


def batches(prompt: str, tokens: list[str], path: str, calls: int, tag: str) -> list[list[bytes]]:
    n = len(tokens)
    return [[request_bytes(chat_body(prompt, f"{tag}-{k}-{j}", 16), path, tokens[j]) for j in range(n)]
            for k in range(max(1, calls // n))]


async def measure(t: Target, reqs: list[list[bytes]], meter: GcMeter) -> dict[str, float]:
    calls = sum(len(b) for b in reqs)
    render0 = t.proxy.render_seconds if t.proxy else 0.0
    writes0 = t.writes()
    gc.collect()
    meter.passes, meter.seconds, meter.on = 0, 0.0, True
    cpu0, all0 = time.thread_time(), time.process_time()
    await t.run(reqs)
    cpu = time.thread_time() - cpu0
    others = time.process_time() - all0 - cpu
    meter.on = False
    return {
        "cpu_ms": cpu / calls * 1e3,
        "threads_ms": max(0.0, others) / calls * 1e3,  # max: the two clocks tick apart by a few microseconds
        "render_ms": (t.proxy.render_seconds - render0) / calls * 1e3 if t.proxy else 0.0,
        "writes": (t.writes() - writes0) / calls,
        "gc_per_1k": meter.passes / calls * 1e3,
        "gc_ms": meter.seconds / calls * 1e3,
    }


async def cyclic_garbage(t: Target, reqs: list[list[bytes]]) -> float:
    """Objects per call that only the cyclic collector frees (kept aside by DEBUG_SAVEALL, then counted)."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        await t.run(reqs)
        gc.collect()
        n = len(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return n / sum(len(b) for b in reqs)


async def main_async(args: argparse.Namespace) -> None:
    prompt, n_tokens = build_prompt(args.prompt_tokens)
    renderer = qwen3_renderer()
    engine = InstantEngine()

    async def emit(m: Any) -> None:
        return None

    settings = ProxySettings()
    if args.render_thread_chars is not None:
        settings.render_thread_chars = args.render_thread_chars
    proxy = Proxy(engine, renderer, emit, settings)  # type: ignore[arg-type]
    await proxy.start()  # its server and render threads; it listens too, but nothing connects
    assert proxy.server is not None
    tokens = [proxy.open_rollout(f"bench-{i}") for i in range(args.clients)]
    targets = {
        "bridle": Target("bridle", proxy.server, "/v1/chat/completions", tokens, proxy),
        "floor": Target("floor", HttpServer(floor_routes(engine, renderer), max_body_bytes=64 << 20),
                        "/io_render/v1/chat/completions", tokens, None),
    }
    meter = GcMeter()
    gc.callbacks.append(meter)
    for name, t in targets.items():  # warm-up: first-use caches, the connections' parsers
        await t.run(batches(prompt, tokens, t.path, 2 * args.clients, f"warm-{name}"))
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
    for r in range(args.rounds):
        order = list(targets) if r % 2 == 0 else list(reversed(targets))
        for name in order:
            t = targets[name]
            reqs = batches(prompt, tokens, t.path, args.calls, f"r{r}-{name}")
            rows[name].append(await measure(t, reqs, meter))
            print(f"round {r} {name}: {rows[name][-1]['cpu_ms']:.3f} ms CPU per call", file=sys.stderr, flush=True)
    garbage = {name: await cyclic_garbage(t, batches(prompt, tokens, t.path, 4 * args.clients, f"gc-{name}"))
               for name, t in targets.items()}
    for t in targets.values():
        t.check_answers()
    gc.callbacks.remove(meter)
    await proxy.stop()

    per_round = max(1, args.calls // args.clients) * args.clients  # whole batches of one call per connection

    def med(name: str, key: str) -> float:
        return statistics.median(row[key] for row in rows[name])

    print(f"\nProxy CPU per call in-process ({n_tokens}-token fresh prompts, {args.clients} calls in flight, "
          f"{per_round} calls per round, {args.rounds} rounds, medians; {event_loop_name()}; no sockets)")
    print(f"{'target':>8}  {'loop ms/call':>12}  {'threads ms/call':>15}  {'render ms/call':>14}  {'writes/call':>11}  "
          f"{'gc passes/1k':>12}  {'gc ms/call':>10}  {'cyclic objects/call':>19}")
    for name, t in targets.items():
        render = f"{med(name, 'render_ms'):.3f}" if t.proxy else "-"
        print(f"{name:>8}  {med(name, 'cpu_ms'):12.3f}  {med(name, 'threads_ms'):15.3f}  {render:>14}  "
              f"{med(name, 'writes'):11.2f}  {med(name, 'gc_per_1k'):12.1f}  {med(name, 'gc_ms'):10.4f}  "
              f"{garbage[name]:19.3f}")
    capture = [b["cpu_ms"] + b["threads_ms"] - f["cpu_ms"] - f["threads_ms"]
               for b, f in zip(rows["bridle"], rows["floor"], strict=True)]
    print(f"capture (bridle - floor, loop and threads, per round): {', '.join(f'{c:.3f}' for c in capture)} ms; "
          f"median {statistics.median(capture):.3f} ms per call")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=3000,
                    help="timed calls per round and target, rounded down to whole batches of --clients")
    ap.add_argument("--clients", type=int, default=64, help="calls in flight (one connection and rollout each)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--render-thread-chars", type=int, default=None,
                    help="bridle's ProxySettings.render_thread_chars (1: tokenize every call in a worker thread)")
    args = ap.parse_args()
    run_main(main_async, args)


if __name__ == "__main__":
    main()
