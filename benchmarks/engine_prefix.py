#!/usr/bin/env python3
"""The embedded engine's prefix cache on harness traffic: recorded agent rollouts replayed at 1, 4 and 16 concurrent
rollouts against two engines, the cache on and off, in one run.

    python benchmarks/engine_prefix.py                                  # Claude Code and OpenClaw, 1 / 4 / 16
    python benchmarks/engine_prefix.py --harnesses claude-code --concurrency 4 --json out.json
    BRIDLE_HARNESS_BIN=~/.cache/bridle/harnesses/node_modules/.bin \\
        python benchmarks/engine_prefix.py --record claude-code         # re-record benchmarks/data/claude-code...

Goal (Claude Code traffic, 4 concurrent rollouts): >= 5x fewer prefill tokens computed and >= 3x calls/s with the
cache on than off.

Traffic. Real harness calls, as token ids: ``benchmarks/data/claude-code.tokens.msgpack.gz`` is one Claude Code
rollout (five calls of 18.8k-19.7k tokens: write a file, run wc, read, write, answer) recorded with ``--record
claude-code``: the real binary through the real proxy over the scripted engine (``tests/helpers/record.py``), saved
as each call's prompt (the tokens it shares with the previous call's prompt + output, then its own) and output.
OpenClaw's (four calls of 8.5k tokens, each dropping the previous call's trailing context turn) is the test fixture
``tests/data/openclaw-3-tools.calls.msgpack.gz``. Re-record after a harness upgrade changes its prompts.

Replay. Rollout ``j`` of a level replays its harness's calls in order. Its first prompt is the recorded one with the
task instruction's tokens rotated by ``j``: the rollouts share the system prompt and tools but not the task (a GRPO
group, which shares its task too, would share more). Each later prompt is what the harness would send: the tokens it
shares with the previous call's prompt + output (the system prompt, the history, the model's own output, here the
engine's sampled tokens), then the recorded rest (tool results, the next turn). The engine samples each output
(temperature 1, a seed per rollout and call, the same in both arms) with ``ignore_eos`` and ``max_new_tokens`` the
recorded output's length, so both arms decode the same number of tokens and send the same prompt lengths. Before each
level the cached engine's cache is flushed (``/flush_cache``): a level starts cold, as an RL step does after its
weight update.

Model: a tiny Qwen3 (``--hidden`` etc.; the defaults keep the full run near 6 minutes on 2 cores) with a reduced
vocabulary covering the recorded ids and 32k positions. Columns: prefill tokens computed and reused (the engine's
``/server_info``), calls/s (calls / wall time of the level), the engine's RSS and the cache's bytes after the level.
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import anyio
import msgspec

from pipeline.messages import ModelCall, ids
from pipeline.models.small import VocabTable, create_small_model
from pipeline.serving.engine import EngineSampling
from pipeline.serving.launch import launch_embedded
from pipeline.serving.sglang_client import HttpEngine

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data"
GOAL = {"harness": "claude-code", "concurrency": 4, "prefill": 5.0, "calls_per_s": 3.0}


class Call(msgspec.Struct, array_like=True):
    """One recorded call: its prompt is the first ``shared`` tokens of the previous call's prompt + output, then
    ``new_ids``; ``output_ids`` is what the model answered."""

    shared: int
    new_ids: list[int]
    output_ids: list[int]


class Recording(msgspec.Struct):
    harness: str
    instruction: str  # the task instruction, as the harness put it into the first prompt
    calls: list[Call]


@dataclass
class Traffic:
    harness: str
    calls: list[tuple[list[int], list[int]]]  # (prompt, output) per call
    instruction: tuple[int, int]  # [start, end) of the instruction's tokens in the first prompt


def _shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def encode(calls: list[tuple[list[int], list[int]]], harness: str, instruction: str) -> bytes:
    out, before = [], []
    for prompt, output in calls:
        n = _shared(prompt, before)
        out.append(Call(shared=n, new_ids=prompt[n:], output_ids=output))
        before = prompt + output
    return gzip.compress(msgspec.msgpack.encode(Recording(harness=harness, instruction=instruction, calls=out)))


def decode(raw: bytes) -> tuple[Recording, list[tuple[list[int], list[int]]]]:
    rec = msgspec.msgpack.decode(gzip.decompress(raw), type=Recording)
    calls, before = [], []
    for c in rec.calls:
        prompt = before[: c.shared] + c.new_ids
        calls.append((prompt, c.output_ids))
        before = prompt + c.output_ids
    return rec, calls


def instruction_span(prompt: list[int], instruction: str) -> tuple[int, int]:
    """Where the instruction's tokens sit in the first prompt. The harness may put a space before it, and its last
    token may merge with what follows (".\n\n" is one token)."""
    from pipeline.tokens.render import qwen3_renderer

    tokenizer = qwen3_renderer().tokenizer
    for text in (instruction, " " + instruction):
        tokens = list(tokenizer.encode(text))
        for needle in (tokens, tokens[:-1]):
            for i in range(len(prompt) - len(needle) + 1):
                if prompt[i : i + len(needle)] == needle:
                    return i, i + len(needle)
    raise ValueError(f"the instruction {instruction!r} is not in the recorded first prompt; re-record it")


def load(harness: str, n_calls: int | None) -> Traffic:
    if harness == "openclaw":  # the tree tests' fixture, ModelCalls as the proxy recorded them
        raw = (ROOT / "tests" / "data" / "openclaw-3-tools.calls.msgpack.gz").read_bytes()
        records = msgspec.msgpack.decode(gzip.decompress(raw), type=list[ModelCall])
        calls = [(ids(c.input_ids).tolist(), ids(c.output_ids).tolist()) for c in records]
        instruction = "Create a.txt, b.txt and c.txt containing alpha, beta and gamma."
    else:
        rec, calls = decode((DATA / f"{harness}.tokens.msgpack.gz").read_bytes())
        instruction = rec.instruction
    calls = calls[:n_calls] if n_calls else calls
    return Traffic(harness, calls, instruction_span(calls[0][0], instruction))


# -------------------------------------------------------------------------------------------------- replay
def first_prompt(t: Traffic, j: int) -> list[int]:
    """Rollout ``j``'s first prompt: the instruction's tokens rotated by ``j`` (reversed too from its length on)."""
    prompt = list(t.calls[0][0])
    a, b = t.instruction
    span = prompt[a:b] if (j // (b - a)) % 2 == 0 else prompt[a:b][::-1]
    k = j % (b - a)
    prompt[a:b] = span[k:] + span[:k]
    return prompt


async def rollout(client: HttpEngine, t: Traffic, j: int) -> int:
    """Replay ``t``'s calls as rollout ``j`` (module docstring); returns the calls made."""
    before: list[int] = []  # the previous call's prompt + the engine's output, as sent and sampled
    recorded_before: list[int] = []
    for k, (prompt, output) in enumerate(t.calls):
        if k == 0:
            sent = first_prompt(t, j)
        else:
            n = _shared(prompt, recorded_before)
            sent = before[:n] + prompt[n:]
        s = EngineSampling(temperature=1.0, max_new_tokens=len(output), ignore_eos=True, seed=1000 * j + k)
        res = await client.generate(sent, s)
        assert len(res.output_ids) == len(output), (t.harness, j, k, res.finish_reason)
        before, recorded_before = sent + res.output_ids, prompt + output
    return len(t.calls)


def rss_mb(client: HttpEngine) -> float:
    pid = client.processes[0].process.pid
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def level(client: HttpEngine, t: Traffic, concurrency: int) -> dict:
    async with aiohttp.ClientSession() as s, s.post(f"{client.base_url}/flush_cache") as r:
        assert r.status == 200, await r.text()
    before = await client.server_info()
    calls = 0
    t0 = time.perf_counter()

    async def one(j: int) -> None:
        nonlocal calls
        made = await rollout(client, t, j)  # not `calls += await ...`: that reads `calls` before the await
        calls += made

    async with anyio.create_task_group() as tg:
        for j in range(concurrency):
            tg.start_soon(one, j)
    wall = time.perf_counter() - t0
    after = await client.server_info()
    return {"calls": calls, "wall_s": wall, "calls_per_s": calls / wall,
            "prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
            "cached_tokens": after["cached_tokens"] - before["cached_tokens"],
            "rss_mb": rss_mb(client), "cache_mb": after["prefix_cache"]["bytes"] / 2**20}


async def measure(args: argparse.Namespace) -> dict:
    traffic = [load(h, args.calls) for h in args.harnesses]
    vocab = VocabTable.from_sequences([x for t in traffic for p, o in t.calls for x in (p, o)])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = create_small_model(Path(tmp) / "model", vocab=vocab, hidden_size=args.hidden, num_layers=args.layers,
                                  num_heads=args.heads, num_kv_heads=args.kv_heads, max_position_embeddings=32768)
        common = {"threads": args.threads, "max_running_requests": max(32, max(args.concurrency)),
                  "timeout_s": 300}
        async with launch_embedded(path, prefix_cache_mb=0, **common) as off, \
                launch_embedded(path, prefix_cache_mb=args.prefix_cache_mb, **common) as on:
            info = await on.server_info()
            for client in (off, on):  # torch's first forward
                await client.generate([1, 2, 3], EngineSampling(max_new_tokens=2, ignore_eos=True))
            for t in traffic:
                for c in args.concurrency:
                    row = {"harness": t.harness, "concurrency": c}
                    for arm, client in (("off", off), ("on", on)):
                        row[arm] = await level(client, t, c)
                    rows.append(row)
                    print_row(row, flush=True)
    return {"rows": rows, "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                                    "kv_heads": args.kv_heads, "vocab_rows": vocab.size,
                                    "kv_bytes_per_token": info["prefix_cache"]["kv_bytes_per_token"]},
            "threads": info["torch_threads"], "prefix_cache_mb": args.prefix_cache_mb,
            "calls_per_rollout": {t.harness: [len(p) for p, _ in t.calls] for t in traffic}}


HEADER = (f"{'harness':<12} {'rollouts':>8} {'arm':>3} {'calls':>5} {'prefill tok':>11} {'reused tok':>10} "
          f"{'calls/s':>8} {'wall s':>7} {'RSS MB':>7} {'cache MB':>8} | {'prefill off/on':>14} {'calls/s on/off':>14}")


def print_row(row: dict, flush: bool = False) -> None:
    off, on = row["off"], row["on"]
    for arm in ("off", "on"):
        r = row[arm]
        ratios = (f" | {off['prefill_tokens'] / max(on['prefill_tokens'], 1):>13.1f}x "
                  f"{on['calls_per_s'] / off['calls_per_s']:>13.2f}x" if arm == "on" else " |")
        print(f"{row['harness']:<12} {row['concurrency']:>8} {arm:>3} {r['calls']:>5} {r['prefill_tokens']:>11,} "
              f"{r['cached_tokens']:>10,} {r['calls_per_s']:>8.3f} {r['wall_s']:>7.1f} {r['rss_mb']:>7.0f} "
              f"{r['cache_mb']:>8.1f}{ratios}", flush=flush)


def verdict(rows: list[dict]) -> str:
    row = next((r for r in rows if (r["harness"], r["concurrency"]) == (GOAL["harness"], GOAL["concurrency"])), None)
    if row is None:
        return f"goal: not measured ({GOAL['harness']} at {GOAL['concurrency']} rollouts)"
    prefill = row["off"]["prefill_tokens"] / max(row["on"]["prefill_tokens"], 1)
    speed = row["on"]["calls_per_s"] / row["off"]["calls_per_s"]
    ok = {True: "met", False: "MISSED"}
    return (f"goal ({GOAL['harness']}, {GOAL['concurrency']} rollouts): prefill tokens {prefill:.1f}x fewer "
            f"(>= {GOAL['prefill']:.0f}x: {ok[prefill >= GOAL['prefill']]}), calls/s {speed:.2f}x "
            f"(>= {GOAL['calls_per_s']:.0f}x: {ok[speed >= GOAL['calls_per_s']]})")


# ------------------------------------------------------------------------------------------------ recording
async def record_claude_code() -> tuple[list[tuple[list[int], list[int]]], str]:
    """One Claude Code rollout through the real proxy over the scripted engine (the tree tests' recipe): each call's
    (prompt, output), and the instruction."""
    import sys

    sys.path.insert(0, str(ROOT))  # tests/ is no package on the path when this runs as a script
    from pipeline.serving.scripted import ScriptCall, ScriptResponse
    from tests.helpers.record import record

    def tool(name: str, **arguments) -> ScriptResponse:
        return ScriptResponse(tool_calls=[ScriptCall(name=name, arguments=arguments)])

    big = "".join(f"line {i:03d}: the quick brown fox jumps over the lazy dog\n" for i in range(40))
    instruction = "Write big.txt, count its lines, then put alpha and beta into notes.txt."
    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp) / "ws"
        proc, calls, _ = await record("claude-code", Path(tmp), [
            tool("Write", file_path=str(ws / "big.txt"), content=big),
            tool("Bash", command=f"wc -l {ws / 'big.txt'} && printf 'alpha\\n' > {ws / 'notes.txt'}",
                 description="Count lines, write notes"),
            tool("Read", file_path=str(ws / "notes.txt")),
            tool("Write", file_path=str(ws / "notes.txt"), content="alpha\nbeta\n"),
            ScriptResponse(text="big.txt has 40 lines; notes.txt holds alpha and beta."),
        ], instruction)
    if proc.returncode != 0 or len(calls) != 5:
        raise SystemExit(f"claude-code exited {proc.returncode} after {len(calls)} calls: {proc.stderr[-2000:]!r}")
    return [(ids(c.input_ids).tolist(), ids(c.output_ids).tolist()) for c in calls], instruction


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--harnesses", default="claude-code,openclaw", type=lambda s: s.split(","))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--calls", type=int, default=0, help="replay only each rollout's first N calls (0: all)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine (one engine runs at a time)")
    p.add_argument("--prefix-cache-mb", type=int, default=1024, help="the cached engine's budget")
    p.add_argument("--json", default="", help="also write the rows here")
    p.add_argument("--record", choices=["claude-code"], help="record the harness's fixture instead of measuring")
    args = p.parse_args()
    if args.record:
        pairs, instruction = anyio.run(record_claude_code)
        instruction_span(pairs[0][0], instruction)  # the replay must find it
        out = DATA / f"{args.record}.tokens.msgpack.gz"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(encode(pairs, args.record, instruction))
        print(f"{out}: {len(pairs)} calls, prompts {[len(p) for p, _ in pairs]} tokens, {out.stat().st_size:,} bytes")
        return
    print(HEADER)
    t0 = time.perf_counter()
    result = anyio.run(measure, args)
    print(verdict(result["rows"]))
    print(f"model {result['model']}, engine torch threads {result['threads']}, cache budget "
          f"{result['prefix_cache_mb']} MiB, prompt tokens per call {result['calls_per_rollout']}, "
          f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
