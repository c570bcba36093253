"""The proxy benchmark's workload (benchmarks/proxy.py): the chat requests it sends (a long user text made unique per
request, so nothing is cached; with ``--turns``, the history an agent harness resends), the prompt sized to a
target token count, and the closed-loop load client that sends them and times each call."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

SYSTEM = "You are a helpful assistant. Answer briefly."
MODEL = "policy"

# ---------------------------------------------------------------------------------------------- prompts
_WORD_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there been one all we their has would when if so no will more can said some into time only "
    "function return value error file line import class module request server client token engine proxy stream "
    "latency throughput render template message assistant system user tool call result output input buffer queue"
)


def long_text(n_words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = _WORD_TEXT.split()
    lines, line = [], []
    for i in range(n_words):
        line.append(rng.choice(words))
        if len(line) == 14 or i == n_words - 1:
            lines.append(" ".join(line) + ".")
            line = []
    return "\n".join(lines)


def user_message(prompt: str, tag: str) -> str:
    return f"Request {tag}. Summarize the following notes in one word.\n\n{prompt}"


def chat_body(prompt: str, tag: str, max_tokens: int, turn: int = 0) -> dict[str, Any]:
    """Call ``turn`` of a conversation: the long first message, then per earlier call the answer ("OK", what the
    zero engine says) and a short follow-up, as an agent harness resends its history (``--turns``)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user_message(prompt, tag)}]
    for k in range(1, turn + 1):
        messages += [{"role": "assistant", "content": "OK"},
                     {"role": "user", "content": f"Step {k} of request {tag}. " + long_text(40, seed=k)}]
    return {"model": MODEL, "messages": messages, "stream": True, "max_tokens": max_tokens}


def build_prompt(target_tokens: int) -> tuple[str, int]:
    """A long user text whose rendered chat prompt is about ``target_tokens`` tokens; (text, rendered length)."""
    from pipeline.tokens.from_wire import from_chat
    from pipeline.tokens.render import qwen3_renderer

    r = qwen3_renderer()
    n_words = target_tokens
    for _ in range(6):
        text = long_text(n_words)
        n = len(r.render_ids(from_chat(chat_body(text, "0-x-0-0", 16))))
        if abs(n - target_tokens) <= 8:
            break
        n_words = max(1, round(n_words * target_tokens / n))
    return text, n


def offline_render_ms(prompt: str, n: int = 40) -> float:
    """Mean Splicer.render time in this (quiet) process, fresh conversation each time, for reference."""
    from pipeline.tokens.from_wire import from_chat
    from pipeline.tokens.render import qwen3_renderer
    from pipeline.tokens.splice import Splicer

    sp = Splicer(qwen3_renderer())
    convs = [from_chat(chat_body(prompt, f"offline-{i}", 16)) for i in range(n + 3)]
    for c in convs[:3]:
        sp.render(c)
    t0 = time.perf_counter()
    for c in convs[3:]:
        sp.render(c)
    return (time.perf_counter() - t0) / n * 1e3


# ------------------------------------------------------------------------------------------ load client
async def run_client(url: str, tokens: list[Any], concurrency: int, requests: int, warmup: int, prompt: str,
                     tag: str, max_tokens: int, turns: int = 1) -> dict[str, Any]:
    import aiohttp

    # a worker takes the next conversation and makes its `turns` calls in order, on its own rollout token
    n_warm = -(-warmup // turns)
    total = n_warm + -(-requests // turns)
    bodies = [[json.dumps(chat_body(prompt, f"{tag}-{i}", max_tokens, t)).encode() for t in range(turns)]
              for i in range(total)]
    # a token is a string (every call to ``url``) or [url, token]: a rollout of a proxy worker, called at its own
    urls = [tokens[w % len(tokens)][0] if tokens and isinstance(tokens[0], list) else url for w in range(concurrency)]
    toks = [t[1] if isinstance(t, list) else t for t in tokens]
    headers = [{"Content-Type": "application/json", **({"Authorization": f"Bearer {toks[w % len(toks)]}"}
                                                        if toks else {})} for w in range(concurrency)]
    lat: list[float] = []
    errors: list[str] = []
    next_i = 0

    async def worker(w: int, stop: int, keep: bool) -> None:
        nonlocal next_i
        while next_i < stop:
            i = next_i
            next_i += 1
            for body in bodies[i]:
                t0 = time.perf_counter()
                try:
                    async with session.post(urls[w], data=body, headers=headers[w]) as resp:
                        data = await resp.read()
                        status = resp.status
                except (TimeoutError, aiohttp.ClientError) as e:
                    errors.append(f"{type(e).__name__}: {e}")
                    break
                t1 = time.perf_counter()
                if status != 200 or b"OK" not in data:
                    errors.append(f"HTTP {status}: {data[:300]!r}")
                    break
                if keep:
                    lat.append(t1 - t0)

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency), timeout=timeout) as session:
        await asyncio.gather(*(worker(w, n_warm, False) for w in range(concurrency)))
        t0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker(w, total, True) for w in range(concurrency)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    # the client's own CPU in the timed phase: part of what the machine spends per request (throughput model)
    return {"latencies": lat, "wall": wall, "cpu": cpu, "errors": len(errors), "first_errors": errors[:3]}
