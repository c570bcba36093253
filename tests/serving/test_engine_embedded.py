"""The embedded engine over real HTTP, through the same client that talks to SGLang.

One engine process (tiny reduced-vocabulary Qwen3 model) serves the whole module. Log-probabilities are checked
against a teacher-forced recomputation with a plain transformers forward of the same weights (pi_rollout vs
pi_old), including requests decoded in a padded batch and requests that straddle a weight update.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import anyio
import anyio.from_thread
import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.models.small import IM_END, IM_START, VocabTable, create_small_model, load_vocab_table
from pipeline.serving.engine import EngineBadRequest, EngineSampling, GenerateResult
from pipeline.serving.launch import launch_embedded
from pipeline.serving.sglang_client import HttpEngine, generate_body, parse_generate

pytestmark = pytest.mark.slow  # every test starts the engine process
ROOT = Path(__file__).resolve().parents[2]

CONTEXT = 512
WORDS = list(range(2000, 2090))
UNKNOWN_ID = 99_999  # a real Qwen id that is not in the table: maps to the UNK slot


class Engine:
    def __init__(self, url: str, paths: dict[str, str]) -> None:
        self.url = url
        self.paths = paths  # weight_version -> checkpoint folder
        self._models: dict[str, torch.nn.Module] = {}

    def model(self, version: str) -> torch.nn.Module:
        if version not in self._models:
            self._models[version] = AutoModelForCausalLM.from_pretrained(
                self.paths[version], dtype=torch.float32
            ).eval()
        return self._models[version]

    def run(self, fn, *args):
        async def main():
            async with HttpEngine(self.url, timeout_s=120) as client:
                return await fn(client, *args)

        return anyio.run(main)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("engine")
    vocab = VocabTable.from_sequences([WORDS])
    kw = {"vocab": vocab, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
    p0 = create_small_model(root / "v0", seed=0, **kw)
    p1 = create_small_model(root / "v1", seed=1, **kw)
    with anyio.from_thread.start_blocking_portal() as portal:
        cm = launch_embedded(p0, threads=1, context_length=CONTEXT, timeout_s=120)
        with portal.wrap_async_context_manager(cm) as client:
            yield Engine(client.base_url, {str(v): str(p1 if v % 2 else p0) for v in range(8)})


async def generate_stream(url: str, input_ids: list[int], sampling: EngineSampling) -> AsyncIterator[GenerateResult]:
    """The engine's streaming /generate as snapshots: cumulative ``data:`` chunks, the last one finished.

    The pipeline never streams from the engine (HttpEngine sends non-streaming calls only); the engine still
    serves streams, as SGLang does."""
    rid = uuid.uuid4().hex
    body = {**generate_body(input_ids, sampling, rid), "stream": True}
    async with aiohttp.ClientSession() as s, s.post(f"{url}/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                return
            yield parse_generate(json.loads(data), rid, require_finish=False)
    raise AssertionError("the stream ended without data: [DONE]")


async def poll_server_info(c: HttpEngine, done: Callable[[dict], bool], interval_s: float = 0.01) -> None:
    """Wait until ``done(/server_info)``: the engine's state lives in another process, so poll it."""
    with anyio.fail_after(120):
        while True:
            if done(await c.server_info()):
                return
            await anyio.sleep(interval_s)


def reference(engine: Engine, prompt: list[int], res: GenerateResult, temperature: float) -> torch.Tensor:
    """Teacher-forced log-probabilities of res.output_ids, each with the weights of the version that sampled it."""
    vocab = load_vocab_table(engine.paths["0"])
    ids = torch.as_tensor(vocab.to_compact(prompt + res.output_ids))
    out = torch.empty(len(res.output_ids))
    bounds = [s for s, _ in res.version_spans] + [len(res.output_ids)]
    for (start, version), end in zip(res.version_spans, bounds[1:], strict=True):
        with torch.no_grad():
            logits = engine.model(version)(input_ids=ids[None]).logits[0].float()
        lp = torch.log_softmax(logits / temperature if temperature >= 1e-6 else logits, dim=-1)
        n = len(prompt)
        out[start:end] = lp[n - 1 + start : n - 1 + end].gather(1, ids[n + start : n + end, None])[:, 0]
    return out


def prompt_of(i: int, n: int) -> list[int]:
    return [IM_START] + [WORDS[(7 * i + 3 * j) % len(WORDS)] for j in range(n)] + [IM_END]


def test_greedy_logprobs_equal_teacher_forcing(engine):
    prompt = prompt_of(0, 12) + [UNKNOWN_ID]
    s = EngineSampling(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    res = engine.run(lambda c: c.generate(prompt, s, rid="greedy-1"))
    assert res.rid == "greedy-1" and res.finish_reason == "length" and len(res.output_ids) == 24
    assert res.prompt_tokens == len(prompt) and res.version_spans == [(0, "0")]
    ref = reference(engine, prompt, res, 0.0)
    assert torch.allclose(torch.tensor(res.logprobs), ref, atol=1e-4, rtol=0)
    # greedy: every token is the argmax of the teacher-forced distribution, i.e. its logprob is the maximum
    vocab = load_vocab_table(engine.paths["0"])
    ids = torch.as_tensor(vocab.to_compact(prompt + res.output_ids))
    with torch.no_grad():
        logits = engine.model("0")(input_ids=ids[None]).logits[0]
    best = logits[len(prompt) - 1 : -1].max(-1).values
    chosen = logits[len(prompt) - 1 : -1].gather(1, ids[len(prompt) :, None])[:, 0]
    assert torch.allclose(best, chosen, atol=1e-5)


def test_concurrent_padded_batch_logprobs_equal_teacher_forcing(engine):
    s = EngineSampling(temperature=0.7, top_p=0.9, top_k=30, max_new_tokens=40, ignore_eos=True)
    prompts = [prompt_of(i, 3 + 9 * i) for i in range(8)]  # different lengths -> left padding in the batch

    async def go(c):
        results = [None] * len(prompts)

        async def one(i):
            results[i] = await c.generate(prompts[i], EngineSampling(**{**_fields(s), "seed": i}), rid=f"b{i}")

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        return results, await c.server_info()

    results, info = engine.run(go)
    assert info["max_batch"] > 1
    for p, res in zip(prompts, results, strict=True):
        assert len(res.output_ids) == len(res.logprobs) == 40
        assert set(res.output_ids) <= set(load_vocab_table(engine.paths["0"]).ids)
        ref = reference(engine, p, res, 0.7)
        assert torch.allclose(torch.tensor(res.logprobs), ref, atol=1e-4, rtol=0), (res.logprobs, ref)


def _fields(s: EngineSampling) -> dict:
    return {f: getattr(s, f) for f in s.__struct_fields__}


def test_unseeded_requests_sample_independently(engine):
    # GRPO needs G different samples of one prompt: unseeded requests must not share a generator seed.
    prompt = prompt_of(3, 10)
    s = EngineSampling(temperature=1.0, max_new_tokens=20, ignore_eos=True)

    async def go(c):
        return [await c.generate(prompt, s) for _ in range(4)]

    outs = engine.run(go)
    assert len({tuple(o.output_ids) for o in outs}) > 1


def test_seed_gives_the_same_tokens_alone_and_in_a_batch(engine):
    prompt = prompt_of(3, 10)
    s = EngineSampling(temperature=1.0, max_new_tokens=30, ignore_eos=True, seed=1234)

    async def go(c):
        alone = await c.generate(prompt, s)
        crowd = {}

        async def one(i):
            crowd[i] = await c.generate(prompt_of(i, 5 + i), EngineSampling(**{**_fields(s), "seed": 1000 + i}))

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, i)
            again = await c.generate(prompt, s)
        other = await c.generate(prompt, EngineSampling(**{**_fields(s), "seed": 99}))
        return alone, again, other

    alone, again, other = engine.run(go)
    assert alone.output_ids == again.output_ids
    assert torch.allclose(torch.tensor(alone.logprobs), torch.tensor(again.logprobs), atol=1e-5)
    assert other.output_ids != alone.output_ids


def test_stop_token_is_included_and_length_finishes(engine):
    prompt = prompt_of(5, 8)
    greedy = EngineSampling(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    first = engine.run(lambda c: c.generate(prompt, greedy))
    stop = first.output_ids[4]
    cut = first.output_ids.index(stop)
    res = engine.run(lambda c: c.generate(prompt, EngineSampling(**{**_fields(greedy), "stop_token_ids": (stop,)})))
    assert res.finish_reason == "stop" and res.matched_stop == stop
    assert res.output_ids == first.output_ids[: cut + 1]
    assert res.logprobs == pytest.approx(first.logprobs[: cut + 1], abs=1e-5)
    zero = engine.run(lambda c: c.generate(prompt, EngineSampling(max_new_tokens=0)))
    assert zero.finish_reason == "length" and zero.output_ids == []


def test_context_limit_ends_with_length(engine):
    prompt = prompt_of(1, CONTEXT - 10)
    res = engine.run(lambda c: c.generate(prompt, EngineSampling(max_new_tokens=100, ignore_eos=True)))
    assert res.finish_reason == "length" and len(prompt) + len(res.output_ids) == CONTEXT


def test_abort_returns_partial_output(engine):
    async def go(c):
        got = []

        async def long():
            got.append(
                await c.generate(prompt_of(2, 5), EngineSampling(max_new_tokens=400, ignore_eos=True), rid="ab-1")
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(long)
            await poll_server_info(c, lambda info: info["running"] > 0)
            await c.abort("ab-1")
        return got[0]

    res = engine.run(go)
    assert res.finish_reason == "abort"
    assert 1 <= len(res.output_ids) < 400 and len(res.logprobs) == len(res.output_ids)


def test_32_concurrent_requests_share_one_batch(engine):
    async def go(c):
        results = {}

        async def one(i):
            results[i] = await c.generate(
                prompt_of(i, 4 + i % 7), EngineSampling(max_new_tokens=16, ignore_eos=True)
            )

        before = await c.server_info()
        await c.pause("in_place")  # hold admission so that all 32 are waiting, then release them together
        async with anyio.create_task_group() as tg:
            for i in range(32):
                tg.start_soon(one, i)
            await poll_server_info(c, lambda info: info["waiting"] >= 32)
            await c.resume()
        return results, before, await c.server_info()

    results, before, after = engine.run(go)
    assert len(results) == 32
    assert all(r.finish_reason == "length" and len(r.output_ids) == 16 for r in results.values())
    assert after["max_batch"] == 32
    assert (
        after["batch_size_histogram"]["32"] >= 15
    )  # every request got its 15 decode steps in the full batch
    assert after["decoded_tokens"] - before["decoded_tokens"] == 32 * 15


def test_streaming_chunks_are_cumulative_and_match_non_streaming(engine):
    prompt = prompt_of(4, 6)
    s = EngineSampling(temperature=0.9, max_new_tokens=10, ignore_eos=True, seed=7)

    async def go(c):
        chunks = [r async for r in generate_stream(engine.url, prompt, s)]
        return chunks, await c.generate(prompt, s)

    chunks, plain = engine.run(go)
    assert [len(c.output_ids) for c in chunks] == list(range(1, 11))
    assert [c.finished for c in chunks] == [False] * 9 + [True]
    assert chunks[-1].output_ids == plain.output_ids and chunks[-1].finish_reason == "length"
    for a, b in itertools.pairwise(chunks):
        assert b.output_ids[: len(a.output_ids)] == a.output_ids


def test_bad_input_gets_400_and_the_engine_keeps_serving(engine):
    good = {"input_ids": [IM_START, 2000], "sampling_params": {"max_new_tokens": 2}}
    cases = [
        (b"{not json", "malformed JSON"),
        (json.dumps({**good, "sampling_params": {"max_new_tokens": 2, "bogus": 1}}), "bogus"),
        (json.dumps({**good, "input_ids": [IM_START, 151_936]}), "outside the vocabulary"),
        (json.dumps({**good, "input_ids": [-1]}), "outside the vocabulary"),
        (json.dumps({**good, "input_ids": [2000] * CONTEXT}), "context length"),
        (json.dumps({**good, "input_ids": []}), "input_ids"),
        (json.dumps({**good, "input_ids": ["a"]}), "input_ids"),
        (json.dumps({"text": "hello"}), "input_ids"),
        (json.dumps({**good, "sampling_params": {"temperature": -1}}), "temperature"),
        (json.dumps({**good, "sampling_params": {"top_p": 0}}), "top_p"),
        (json.dumps({**good, "sampling_params": {"frequency_penalty": 0.5}}), "frequency_penalty"),
        (json.dumps([1, 2]), "JSON object"),
    ]

    async def go(c):
        out = []
        async with aiohttp.ClientSession() as s:
            for body, _ in cases:
                async with s.post(f"{engine.url}/generate", data=body) as r:
                    out.append((r.status, (await r.json())["message"]))
            async with s.post(f"{engine.url}/update_weights_from_disk", data=b"[") as r:
                out.append((r.status, (await r.json())["message"]))
        try:
            await c.update_weights("/nonexistent/ckpt", 9)
        except EngineBadRequest as e:
            out.append((400, str(e)))
        ok = await c.generate([IM_START, 2000], EngineSampling(max_new_tokens=2, ignore_eos=True))
        return out, ok, await c.health(), await c.model_info()

    out, ok, healthy, info = engine.run(go)
    for (status, message), (_, needle) in zip(out[: len(cases)], cases, strict=True):
        assert status == 400 and needle in message, (status, message, needle)
    assert out[-2][0] == 400 and "malformed JSON" in out[-2][1]
    assert "not a directory" in out[-1][1]
    assert len(ok.output_ids) == 2 and healthy and int(info["weight_version"]) % 2 == 0


def test_update_weights_mid_request_records_version_spans(engine):
    """Pause after a few streamed tokens, swap weights, continue: tokens after the swap come from version 1,
    and every token's logprob equals teacher forcing with the weights that sampled it."""
    prompt = prompt_of(6, 9)
    s = EngineSampling(temperature=0.8, max_new_tokens=30, ignore_eos=True, seed=5)
    long = EngineSampling(**{**_fields(s), "max_new_tokens": 300})

    async def go(c):
        others = []
        start = (await c.model_info())["weight_version"]

        async def other(i):
            others.append((i, await c.generate(prompt_of(i, 4 + i), EngineSampling(**{**_fields(s), "seed": i}))))

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(other, i)
            chunks = 0
            async for snap in generate_stream(engine.url, prompt, long):
                chunks += 1
                if chunks == 5:
                    await c.pause("in_place")
                    await c.update_weights(engine.paths["1"], 1)
                    await c.resume()
                last = snap
        info = await c.model_info()
        await c.update_weights(engine.paths["2"], 2)  # back to the seed-0 weights for later tests
        return last, others, info, start

    res, others, info, start = engine.run(go)
    assert info["weight_version"] == "1"
    assert res.finish_reason == "length" and len(res.output_ids) == 300
    # the pause lands a few steps after the 5th chunk reached the client; the swap applies between two steps
    [(zero, v0), (switch, v1)] = res.version_spans
    assert (zero, v0, v1) == (0, start, "1") and 5 <= switch < 300 and res.weight_version == "1"
    # on the wire exactly as SGLang 0.5.23 reports it: half-open [start, end) output token ranges
    assert res.meta["weight_versions"] == [
        {"version": start, "start": 0, "end": switch},
        {"version": "1", "start": switch, "end": 300},
    ]
    assert [sp.version for sp in res.spans()] == [int(start), 1]
    ref = reference(engine, prompt, res, 0.8)
    assert torch.allclose(torch.tensor(res.logprobs), ref, atol=1e-4, rtol=0)
    for i, r in others:
        assert r.finish_reason == "length" and len(r.output_ids) == 30
        assert torch.allclose(
            torch.tensor(r.logprobs), reference(engine, prompt_of(i, 4 + i), r, 0.8), atol=1e-4
        )


def test_update_weights_without_pause_fails_no_request(engine):
    """An update lands between two decode steps of a running batch; every request finishes normally."""
    s = EngineSampling(temperature=1.0, max_new_tokens=300, ignore_eos=True)
    prompts = [prompt_of(i, 5 + 2 * i) for i in range(8)]

    async def go(c):
        results = {}
        start = (await c.model_info())["weight_version"]

        async def one(i):
            results[i] = await c.generate(prompts[i], EngineSampling(**{**_fields(s), "seed": 50 + i}))

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(one, i)
            await poll_server_info(c, lambda info: info["running"] >= 8, 0.005)
            await c.update_weights(engine.paths["3"], 3)
        await c.update_weights(engine.paths["4"], 4)  # back to the seed-0 weights
        return results, start

    results, start = engine.run(go)
    assert all(r.finish_reason == "length" and len(r.output_ids) == 300 for r in results.values())
    assert any(len(r.version_spans) == 2 for r in results.values())
    for i, r in results.items():
        assert [v for _, v in r.version_spans] in ([start], [start, "3"], ["3"])
        assert torch.allclose(torch.tensor(r.logprobs), reference(engine, prompts[i], r, 1.0), atol=1e-4)


def test_the_next_call_reuses_the_prefix_cache_and_flush_cache_empties_it(engine):
    """A rollout's second call (its first call's prompt and output and a tool result) reuses the cached KV and says
    so in ``meta_info["cached_tokens"]`` as SGLang does; ``/server_info`` counts it; ``/flush_cache`` (GET or POST,
    as SGLang serves it) empties the cache and the same call is computed in full again."""
    s = EngineSampling(temperature=0.9, max_new_tokens=12, ignore_eos=True, seed=11)
    first_prompt = prompt_of(8, 30)

    async def flush(method: str) -> tuple[int, str]:
        async with aiohttp.ClientSession() as session, session.request(method, f"{engine.url}/flush_cache") as r:
            return r.status, await r.text()

    async def go(c):
        await flush("POST")  # what earlier tests left (their prompts too start with <|im_start|>)
        first = await c.generate(first_prompt, s)
        second_prompt = first_prompt + first.output_ids + [IM_START, 2001, 2002, IM_END]
        before = await c.server_info()
        second = await c.generate(second_prompt, s)
        after = await c.server_info()
        flushed = [await flush("POST"), await flush("GET")]
        emptied = await c.server_info()
        again = await c.generate(second_prompt, s)
        return second_prompt, first, second, before, after, flushed, emptied, again

    prompt, first, second, before, after, flushed, emptied, again = engine.run(go)
    assert first.meta["cached_tokens"] == 0
    # everything but the first call's last token, which the engine sampled and never fed back
    assert second.meta["cached_tokens"] == len(first_prompt) + len(first.output_ids) - 1
    assert after["cached_tokens"] - before["cached_tokens"] == second.meta["cached_tokens"]
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(prompt) - second.meta["cached_tokens"]
    assert after["cache_hits"] == before["cache_hits"] + 1 and after["prefix_cache"]["tokens"] >= len(prompt)
    assert 0 < after["prefix_cache"]["bytes"] <= after["prefix_cache"]["budget_bytes"]
    assert [status for status, _ in flushed] == [200, 200]
    assert flushed[0][1].startswith("Cache flushed.\n") and "0 cached prefix tokens" in flushed[1][1]
    cache = emptied["prefix_cache"]
    assert (cache["tokens"], cache["bytes"], cache["flushes"]) == (0, 0, before["prefix_cache"]["flushes"] + 2)
    assert again.meta["cached_tokens"] == 0 and again.output_ids == second.output_ids
    for res in (second, again):
        assert torch.allclose(torch.tensor(res.logprobs), reference(engine, prompt, res, 0.9), atol=1e-4, rtol=0)


def test_a_weight_update_empties_the_prefix_cache(engine):
    """KV computed with the old weights never serves the new ones: the same prompt after an update reuses nothing,
    and its log-probabilities are the new weights'."""
    prompt = prompt_of(9, 40)
    s = EngineSampling(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=3)

    async def go(c):
        start = int((await c.model_info())["weight_version"])
        await c.generate(prompt, s)
        await c.update_weights(engine.paths[str(start + 1)], start + 1)
        info = await c.server_info()
        res = await c.generate(prompt, s)
        await c.update_weights(engine.paths[str(start + 2)], start + 2)  # back to the weights the module started with
        return info, res

    info, res = engine.run(go)
    assert info["prefix_cache"]["tokens"] == 0 and res.meta["cached_tokens"] == 0
    assert torch.allclose(torch.tensor(res.logprobs), reference(engine, prompt, res, 1.0), atol=1e-4, rtol=0)


def test_a_restart_replaces_the_port_file_a_crashed_engine_left(tmp_path):
    """In a run folder the port file sits next to the engine's log under a fixed name, so a resumed run's engine
    finds the one a kill -9 left: it must be replaced, never read as the new engine's port."""
    model = create_small_model(tmp_path / "m", seed=0, vocab=VocabTable.from_sequences([WORDS]), hidden_size=32,
                               num_layers=1, num_heads=2, num_kv_heads=1)
    log = tmp_path / "engine-embedded.log"
    stale = tmp_path / "engine-embedded.log.port"
    stale.mkdir()
    (stale / "port").write_text("9")

    async def main() -> None:
        async with launch_embedded(model, threads=1, context_length=CONTEXT, timeout_s=120, log_path=log) as c:
            assert not c.base_url.endswith(":9") and await c.health()
        assert not stale.exists()  # and gone after a clean stop

    anyio.run(main)


LAUNCHER = """
import sys, anyio
from pathlib import Path
from pipeline.serving.launch import launch_embedded
async def main():
    async with launch_embedded(sys.argv[1], threads=1, timeout_s=120, log_path=Path(sys.argv[2])):
        await anyio.sleep_forever()
anyio.run(main)
"""


def _engine_child(parent: int) -> int | None:
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if ppid == parent and b"pipeline.serving.embedded" in cmd:
                return int(d.name)
    return None


def test_an_engine_whose_launcher_is_killed_while_it_starts_stops_by_itself(tmp_path):
    """kill -9 of the launcher (run.py) while the engine imports and loads its model: the engine took its parent's
    pid only once it served, by then init's, and so served for ever (the fault campaign, benchmarks/faults.py,
    found one 150 s after its run had been resumed). It now knows its launcher from the start, stops by itself and
    publishes no port (which the launcher's next start could read as its own engine's)."""
    from pipeline.cli.invariants import process_start

    model = create_small_model(tmp_path / "m", seed=0, vocab=VocabTable.from_sequences([WORDS]), hidden_size=32,
                               num_layers=1, num_heads=2, num_kv_heads=1)
    log = tmp_path / "engine-embedded.log"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(model), str(log)], cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    engine = None
    try:
        deadline = time.monotonic() + 60
        while engine is None and time.monotonic() < deadline and launcher.poll() is None:
            engine = _engine_child(launcher.pid)
            time.sleep(0.05)
        assert engine is not None, "the launcher started no engine"
    finally:
        launcher.kill()
        launcher.wait()
    try:
        deadline = time.monotonic() + 90
        while process_start(engine) is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert process_start(engine) is None, "the engine outlived its launcher"
        assert not (tmp_path / "engine-embedded.log.port" / "port").exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine, signal.SIGKILL)
    assert "parent process exited" in log.read_text()


def test_model_info_names_device_and_dtype(engine):
    info = engine.run(lambda c: c.model_info())
    assert (info["device"], info["dtype"]) == ("cpu", "float32")


def test_bfloat16_engine_samples_what_bf16_teacher_forcing_gives(tmp_path):
    """``dtype = "bfloat16"`` ([proxy.engine] dtype) serves the weights in bf16: greedy tokens and their logprobs
    are a bf16 teacher-forced forward's, within bf16's rounding."""
    vocab = VocabTable.from_sequences([WORDS])
    path = create_small_model(tmp_path / "m", vocab=vocab, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    prompt = prompt_of(3, 10)
    s = EngineSampling(temperature=0.0, max_new_tokens=12, ignore_eos=True)

    async def main():
        async with launch_embedded(path, threads=1, dtype="bfloat16", timeout_s=120) as c:
            return await c.model_info(), await c.generate(prompt, s)

    info, res = anyio.run(main)
    assert (info["device"], info["dtype"]) == ("cpu", "bfloat16")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.as_tensor(vocab.to_compact(prompt + res.output_ids))
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids[None]).logits[0].float(), dim=-1)[len(prompt) - 1 : -1]
    assert torch.allclose(torch.tensor(res.logprobs), lp.gather(1, ids[len(prompt) :, None])[:, 0], atol=2e-2)


@pytest.mark.parametrize("device", ["cuda:99", "tpu"])
def test_a_device_the_machine_lacks_is_refused_with_what_to_do(tmp_path, device):
    """The engine exits at start, and the launcher's error carries the engine's reason (the option and the fix)."""
    path = create_small_model(tmp_path / "m", vocab=VocabTable.from_sequences([WORDS]), hidden_size=32,
                              num_layers=1, num_heads=2, num_kv_heads=1)

    async def main():
        async with launch_embedded(path, threads=1, device=device, timeout_s=120):
            pass

    with pytest.raises(RuntimeError, match=f"--device '{device}'"):
        anyio.run(main)
