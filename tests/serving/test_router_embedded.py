"""Two embedded engines behind the real sglang-router, opened as a run opens them (``[proxy.engine] replicas = 2``):
harness calls through the proxy spread over both, every weight update reaches both (their answers' log-probabilities
are the new weights', token for token), and a call that spans an update records both versions at the right token;
routed ``cache_aware`` (the default), each rollout's calls stay on the engine whose prefix cache holds them.

One fleet (two engine processes and the router, tiny reduced-vocabulary Qwen3 models), routed round_robin so that
the spread is known, serves the module; the cache_aware test starts its own. Each
engine counts the requests it served (``/server_info``), which says where the router sent them. Log-probabilities
are checked against a teacher-forced recomputation with a plain transformers forward of the weights each span names.
"""

from __future__ import annotations

import aiohttp
import anyio
import anyio.from_thread
import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.messages import ModelCall, VersionSpan
from pipeline.models.small import IM_END, IM_START, VocabTable, create_small_model, load_vocab_table
from pipeline.serving.engine import EngineSampling, GenerateResult
from pipeline.serving.engine_call import result_versions
from pipeline.serving.factory import EngineSettings, open_engine
from pipeline.serving.proxy import Proxy, ProxySettings
from pipeline.serving.router import INSTALL, RouterSettings, router_available
from pipeline.serving.sglang_client import HttpEngine
from tests.helpers.ci import require
from tests.helpers.proxyutil import Records, renderer

pytestmark = pytest.mark.slow  # two engine processes and the router

WORDS = list(range(2000, 2090))


class Fleet:
    def __init__(self, url: str, workers: list[str], paths: dict[str, str], log_dir) -> None:
        self.url, self.workers, self.paths, self.log_dir = url, workers, paths, log_dir
        self._models: dict[str, torch.nn.Module] = {}

    def client(self) -> HttpEngine:
        """A client on the running test's event loop: generation through the router, control to each engine."""
        return HttpEngine(self.url, control_urls=self.workers, timeout_s=120)

    async def served(self) -> list[int]:
        """How many requests each engine has taken, by its own count."""
        out = []
        for url in self.workers:
            async with HttpEngine(url) as w:
                out.append((await w.server_info())["requests"])
        return out

    def reference(self, prompt: list[int], res: GenerateResult, temperature: float) -> torch.Tensor:
        """Teacher-forced log-probabilities of res.output_ids, each with the weights of the version its span names."""
        ids = torch.as_tensor(load_vocab_table(self.paths["0"]).to_compact(prompt + res.output_ids))
        out = torch.empty(len(res.output_ids))
        bounds = [s for s, _ in res.version_spans] + [len(res.output_ids)]
        for (start, version), end in zip(res.version_spans, bounds[1:], strict=True):
            if version not in self._models:
                self._models[version] = AutoModelForCausalLM.from_pretrained(self.paths[version],
                                                                             dtype=torch.float32).eval()
            with torch.no_grad():
                logits = self._models[version](input_ids=ids[None]).logits[0].float()
            lp = torch.log_softmax(logits / temperature, dim=-1)
            n = len(prompt)
            out[start:end] = lp[n - 1 + start: n - 1 + end].gather(1, ids[n + start: n + end, None])[:, 0]
        return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    require(router_available(), f"sglang-router is not installed ({INSTALL})")
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("fleet")
    kw = {"vocab": VocabTable.from_sequences([WORDS]), "hidden_size": 64, "num_layers": 2, "num_heads": 4,
          "num_kv_heads": 2}
    p0 = create_small_model(root / "v0", seed=0, **kw)
    p1 = create_small_model(root / "v1", seed=1, **kw)
    settings = EngineSettings(kind="embedded", replicas=2, threads=1, context_len=512,
                              router=RouterSettings(policy="round_robin"))
    with anyio.from_thread.start_blocking_portal() as portal, \
            portal.wrap_async_context_manager(open_engine(settings, renderer(), model=str(p0), run_dir=root)) as eng:
        assert [p.name for p in eng.processes] == ["router", "engine 0", "engine 1"]
        # odd versions are the seed-1 weights, even ones the seed-0 weights
        yield Fleet(eng.base_url, eng.control_urls, {str(v): str(p1 if v % 2 else p0) for v in range(6)}, root)


def prompt_of(i: int, n: int) -> list[int]:
    return [IM_START] + [WORDS[(7 * i + 3 * j) % len(WORDS)] for j in range(n)] + [IM_END]


def test_proxy_calls_spread_over_both_engines(fleet):
    """Six harness calls (OpenAI chat) through the proxy: the router sends three to each engine, and each call is
    recorded with the version that sampled it."""
    async def main():
        records = Records()
        async with fleet.client() as eng:
            version = int(await eng.check_versions())
            proxy = Proxy(eng, renderer(), records.add, ProxySettings())
            proxy.policy_version = version
            await proxy.start()
            try:
                token = proxy.open_rollout("r1")
                before = await fleet.served()
                async with aiohttp.ClientSession() as s:
                    for i in range(6):
                        body = {"model": "policy", "max_tokens": 4, "messages": [{"role": "user", "content": f"q{i}"}]}
                        async with s.post(f"{proxy.base_url}/v1/chat/completions", json=body,
                                          headers={"Authorization": f"Bearer {token}"}) as r:
                            assert r.status == 200, await r.text()
                after = await fleet.served()
            finally:
                await proxy.stop()
        return version, records, before, after

    version, records, before, after = anyio.run(main)
    assert [a - b for a, b in zip(after, before, strict=True)] == [3, 3]
    calls = [r for r in records if isinstance(r, ModelCall)]
    assert len(calls) == 6 and all(c.versions == [VersionSpan(0, version)] for c in calls)
    assert all((fleet.log_dir / f"engine-embedded-{i}.log").exists() for i in range(2))
    assert (fleet.log_dir / "engine-embedded-router.log").exists()


def test_every_weight_update_reaches_both_engines(fleet):
    """After an update every engine reports the new version, and both engines' answers (the router alternates)
    have exactly the new weights' log-probabilities."""
    prompts = [prompt_of(i, 5 + i) for i in range(4)]
    s = EngineSampling(temperature=1.0, max_new_tokens=12, ignore_eos=True)

    async def main():
        async with fleet.client() as eng:
            await eng.update_weights(fleet.paths["1"], 1)
            versions = await eng.worker_versions()
            before = await fleet.served()
            results = [await eng.generate(p, EngineSampling(**{**_fields(s), "seed": i})) for i, p in enumerate(prompts)]
            after = await fleet.served()
            await eng.update_weights(fleet.paths["2"], 2)  # back to the seed-0 weights for later tests
            return versions, results, before, after, await eng.worker_versions()

    versions, results, before, after, restored = anyio.run(main)
    assert list(versions.values()) == ["1", "1"] and list(restored.values()) == ["2", "2"]
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 2]
    for p, r in zip(prompts, results, strict=True):
        assert r.version_spans == [(0, "1")]
        assert torch.allclose(torch.tensor(r.logprobs), fleet.reference(p, r, 1.0), atol=1e-4)


def test_a_call_spanning_an_update_records_both_versions_at_the_right_token(fleet):
    """Pause both engines once the call has a few tokens, update both, continue: the answer (through the router)
    gives the old version the tokens before the switch and the new one the rest, and every token's log-probability
    is the one its version's weights give, so the switch is at the right token (the two models differ)."""
    prompt = prompt_of(6, 9)
    s = EngineSampling(temperature=0.8, max_new_tokens=300, ignore_eos=True, seed=5)

    async def main():
        async with fleet.client() as eng:
            start = await eng.check_versions()
            base = await _decoded(fleet.workers)
            out: dict[str, GenerateResult] = {}

            async def call():
                out["res"] = await eng.generate(prompt, s)

            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await _until_decoded(fleet.workers, base + 5)
                await eng.pause("in_place")
                await eng.update_weights(fleet.paths["3"], 3)
                versions = await eng.worker_versions()
                await eng.resume()
            await eng.update_weights(fleet.paths["4"], 4)  # back to the seed-0 weights
            return start, out["res"], versions

    start, res, versions = anyio.run(main)
    assert list(versions.values()) == ["3", "3"]
    assert res.finish_reason == "length" and len(res.output_ids) == 300
    [(zero, v0), (switch, v1)] = res.version_spans
    assert (zero, v0, v1) == (0, start, "3") and 5 <= switch < 300
    # what the proxy records in ModelCall.versions
    assert result_versions(res, fallback=0) == [VersionSpan(0, int(start)), VersionSpan(switch, 3)]
    ref = fleet.reference(prompt, res, 0.8)
    assert torch.allclose(torch.tensor(res.logprobs), ref, atol=1e-4, rtol=0)
    # one token off either way would put a token under the other weights: its log-probability would not match
    shifted = GenerateResult(**{**_fields(res), "version_spans": [(0, start), (switch + 1, "3")]})
    assert not torch.allclose(torch.tensor(res.logprobs), fleet.reference(prompt, shifted, 0.8), atol=1e-4)


async def _decoded(workers: list[str]) -> int:
    """Tokens the engines have decoded, all together (the engines' state lives in other processes: poll it)."""
    total = 0
    for url in workers:
        async with HttpEngine(url) as w:
            total += (await w.server_info())["decoded_tokens"]
    return total


async def _until_decoded(workers: list[str], n: int) -> None:
    with anyio.fail_after(120):
        while True:
            if await _decoded(workers) >= n:
                return
            await anyio.sleep(0.005)


def _fields(obj) -> dict:
    return {f: getattr(obj, f) for f in obj.__struct_fields__}


def test_cache_aware_routing_keeps_each_rollout_on_the_engine_that_cached_it(tmp_path):
    """``policy = "auto"`` (cache_aware) over embedded engines: concurrent rollouts of three calls each, every call
    extending the previous one's prompt and output. The router sends each later call to the engine that served
    the earlier ones, whose prefix cache then holds all but the previous call's last token; the answers are
    exact."""
    require(router_available(), f"sglang-router is not installed ({INSTALL})")
    model = create_small_model(tmp_path / "m", seed=0, vocab=VocabTable.from_sequences([WORDS]), hidden_size=64,
                               num_layers=2, num_heads=4, num_kv_heads=2)
    settings = EngineSettings(kind="embedded", replicas=2, threads=1, context_len=1024)
    assert settings.router.resolved_policy() == "cache_aware"

    async def main():
        calls = []

        async def rollout(eng, i):
            prompt = prompt_of(i, 150)
            for turn in range(3):
                res = await eng.generate(prompt, EngineSampling(max_new_tokens=8, ignore_eos=True, seed=i))
                calls.append((i, turn, prompt, res))
                prompt = prompt + res.output_ids + [IM_START, WORDS[turn], IM_END]

        async with open_engine(settings, renderer(), model=str(model), run_dir=tmp_path) as eng:
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(rollout, eng, i)
            served = []
            for url in eng.control_urls:
                async with HttpEngine(url) as w:
                    served.append((await w.server_info())["requests"])
        return calls, served

    calls, served = anyio.run(main)
    assert sum(served) == 12
    by_call = {(i, turn): (prompt, res) for i, turn, prompt, res in calls}
    for (i, turn), (prompt, res) in by_call.items():
        if turn:
            before, previous = by_call[(i, turn - 1)]
            assert res.meta["cached_tokens"] == len(before) + len(previous.output_ids) - 1, (i, turn)
        ref = Fleet("", [], {"0": str(model)}, tmp_path).reference(prompt, res, 1.0)
        assert torch.allclose(torch.tensor(res.logprobs), ref, atol=1e-4, rtol=0)
