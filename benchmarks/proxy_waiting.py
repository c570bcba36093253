#!/usr/bin/env python3
"""What calls cost the proxy while they wait on a slow engine: its CPU per second with N streaming calls in flight.

    python benchmarks/proxy_waiting.py                       # 100, 500, 2000 calls waiting
    python benchmarks/proxy_waiting.py --calls 4000 --window 5

Why: a real engine takes seconds per call, and with hundreds of sandboxes per proxy most calls are waiting at any
moment. Whatever the proxy does per waiting call (polling the connection, timers) is paid by every call every
second, on the loop that also renders. Set-up: ``pipeline.serving.proxy.Proxy`` in this process over the scripted
engine (in-process; each answer after ``--engine-s`` seconds, a sleeping task), one rollout; a load client in a
child process opens N streaming chat completions at once. Once all N are waiting (heads sent, no keep-alive due:
``keepalive_s`` is longer than the engine takes), this process's CPU (user + system, from ``getrusage``) is read
over ``--window`` seconds. Reported per N: ms of CPU per second, and per 1,000 waiting calls. No goal: a number to
watch (the loop should spend nothing on a call between its keep-alives).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time

CLIENT = r"""
import asyncio, sys, aiohttp
async def main(url, token, n):
    body = {"model": "policy", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as s:
        async def one():
            async with s.post(url, headers={"Authorization": "Bearer " + token}, json=body) as r:
                assert r.status == 200 and (await r.read()).rstrip().endswith(b"[DONE]")
        await asyncio.gather(*(one() for _ in range(n)))
asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def measure(n: int, engine_s: float, window: float) -> float:
    """ms of this process's CPU per second while ``n`` calls wait."""
    from pipeline.core.logs import configure
    from pipeline.serving.proxy import Proxy, ProxySettings
    from pipeline.serving.scripted import Script, ScriptedEngine, ScriptResponse
    from pipeline.tokens.render import qwen3_renderer

    configure(level="warning")
    renderer = qwen3_renderer()
    script = Script(default=[ScriptResponse(text="OK")], latency_s=engine_s)

    async def emit(_: object) -> None:
        pass

    proxy = Proxy(ScriptedEngine(renderer, script), renderer, emit,
                  ProxySettings(port=0, keepalive_s=engine_s + 60.0))
    await proxy.start()
    token = proxy.open_rollout("waiting")
    client = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT,
                                                  proxy.base_url + "/v1/chat/completions", token, str(n))
    try:
        deadline = time.monotonic() + engine_s - window - 1.0
        while proxy.pending("waiting") < n:
            if time.monotonic() > deadline or client.returncode is not None:
                raise RuntimeError(f"{proxy.pending('waiting')} of {n} calls were waiting before the window; raise "
                                   "--engine-s (the client could not open them all in time)")
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # the stream heads (sent after stream_head_s) are out
        c0, t0 = cpu_seconds(), time.monotonic()
        await asyncio.sleep(window)
        c1, t1 = cpu_seconds(), time.monotonic()
        if await asyncio.wait_for(client.wait(), engine_s + 60) != 0:  # every call answered: the client checks each
            raise RuntimeError(f"the load client failed (exit {client.returncode})")
        return 1e3 * (c1 - c0) / (t1 - t0)
    finally:
        if client.returncode is None:
            client.kill()
            await client.wait()
        await proxy.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, nargs="+", default=[100, 500, 2000], help="calls waiting at once")
    ap.add_argument("--engine-s", type=float, default=15.0, help="seconds the engine takes per call")
    ap.add_argument("--window", type=float, default=3.0, help="seconds measured while every call waits")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # a socket per call, here and in the client
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 2 * max(args.calls) + 256)), hard))
    print(f"Proxy CPU while calls wait on an engine that takes {args.engine_s:g} s ({args.window:g} s window)")
    print(f"{'calls waiting':>13}  {'CPU ms/s':>8}  {'per 1,000 calls':>15}")
    for n in args.calls:
        ms = asyncio.run(measure(n, args.engine_s, args.window))
        print(f"{n:>13}  {ms:>8.1f}  {1000 * ms / n:>15.1f}", flush=True)


if __name__ == "__main__":
    main()
