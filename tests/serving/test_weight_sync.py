"""Weight sync without the disk, for real: embedded engine processes join a gloo process group with this test as
rank 0 (the learner's end, :class:`WeightPusher`), receive new weights by broadcast, and then sample exactly what an
engine started from the same weights on disk samples. A broadcast the engine must refuse fails the update cleanly,
and the disk path still works after it (the fallback)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import aiohttp
import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest
import torch
from safetensors.torch import load_file

from actors.learner import LearnerActor, LearnerSettings
from pipeline.core.runtime import ActorContext, Output
from pipeline.messages import EngineReady
from pipeline.models.small import VocabTable, create_small_model, load_vocab_table
from pipeline.serving.engine import EngineBadRequest, EngineSampling
from pipeline.serving.launch import launch_embedded
from pipeline.serving.sglang_client import HttpEngine
from pipeline.serving.weight_sync import WeightPusher, manifest
from pipeline.training.learner import Learner
from pipeline.training.ranks import InProcess
from pipeline.training.stage import StageSettings

pytestmark = pytest.mark.slow  # starts engine processes

WORDS = list(range(2000, 2090))
PROMPT = [2001, 2005, 2010, 2020, 2030]
GREEDY = EngineSampling(temperature=0.0, max_new_tokens=12, ignore_eos=True)


def weights(path: str) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors, as the learner holds them (float32)."""
    return load_file(f"{path}/model.safetensors")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("wsync")
    kw = {"vocab": VocabTable.from_sequences([WORDS]), "hidden_size": 64, "num_layers": 2, "num_heads": 4,
          "num_kv_heads": 2}
    return str(create_small_model(root / "v0", seed=0, **kw)), str(create_small_model(root / "v1", seed=1, **kw))


@pytest.fixture(scope="module")
def engines(models):
    """Two engines on the seed-0 weights (the ones pushed to) and one on the seed-1 weights (the reference)."""
    torch.set_num_threads(1)
    p0, p1 = models
    with anyio.from_thread.start_blocking_portal() as portal, contextlib.ExitStack() as stack:
        urls = [stack.enter_context(portal.wrap_async_context_manager(
            launch_embedded(p, threads=1, context_length=256, timeout_s=120))).base_url for p in (p0, p0, p1)]
        yield urls


def run(fn):
    return anyio.run(fn)


async def sample(url: str) -> tuple[list[int], list[float], str, int]:
    """Output ids, logprobs, version, and the prompt tokens the engine's prefix cache supplied."""
    async with HttpEngine(url) as c:
        r = await c.generate(PROMPT, GREEDY)
        return r.output_ids, r.logprobs, r.weight_version, r.meta["cached_tokens"]


def test_broadcast_weights_sample_what_the_same_weights_from_disk_sample(engines, models):
    a, b, ref = engines
    before = run(lambda: sample(a))
    expected = run(lambda: sample(ref))
    assert before[0] != expected[0]  # the two policies differ, so the check below has teeth
    assert run(lambda: sample(a))[3] == len(PROMPT) - 1  # the prompt's KV of the old weights is cached

    async def main():
        pusher = WeightPusher([a, b], timeout_s=60)
        try:
            await pusher.join()
            await pusher.push(weights(models[1]), 7)
            return await pusher.engine.worker_versions(), await sample(a), await sample(b)
        finally:
            await pusher.close()

    versions, got_a, got_b = run(main)
    assert versions == {a: "7", b: "7"}
    for got in (got_a, got_b):
        assert got[0] == expected[0]
        assert got[1] == pytest.approx(expected[1], abs=1e-5)
        assert got[2] == "7" and got[3] == 0  # the broadcast emptied the cache: nothing of the old weights served

    async def back_from_disk():  # the disk path still works once the group is gone
        async with HttpEngine(a, control_urls=[a, b]) as c:
            await c.update_weights(models[0], 8)
        return await sample(a)

    restored = run(back_from_disk)
    assert restored[0] == before[0] and restored[2] == "8"


def test_a_refused_broadcast_fails_the_update_and_leaves_the_version(engines, models):
    a, _, _ = engines

    async def main():
        pusher = WeightPusher([a], timeout_s=60)
        try:
            await pusher.join()
            bad = weights(models[1])
            bad["model.norm.weight"] = torch.ones(3)  # the wrong shape: the engine must refuse it
            with pytest.raises(EngineBadRequest, match=r"model\.norm\.weight has shape \(3,\)"):
                await pusher.push(bad, 9)
            version = (await pusher.engine.worker_versions())[a]
            # the session was closed: the next update over the same group goes through
            await pusher.push(weights(models[0]), 10)
            return version, (await pusher.engine.worker_versions())[a]
        finally:
            await pusher.close()

    before = run(lambda: sample(a))[2]
    refused, after = run(main)
    assert refused == before and after == "10"


def test_a_group_that_cannot_be_set_up_fails_join_and_leaves_no_group(engines):
    a, _, _ = engines

    async def main():
        async with HttpEngine(a) as c:
            with pytest.raises(EngineBadRequest, match="sync_backend = \"gloo\""):
                await c.init_weights_update_group("127.0.0.1", 1, anyio.lowlevel.checkpoint, backend="nccl",
                                                  group_name="weight_update_group")
            # nothing joined, so there is nothing to leave
            with pytest.raises(EngineBadRequest, match="does not exist"):
                await c.destroy_weights_update_group("weight_update_group")

    run(main)


def test_manifest_lists_names_dtypes_and_shapes_in_order():
    t = {"b": torch.zeros(2, 3, dtype=torch.bfloat16), "a": torch.zeros(4)}
    assert manifest(t) == (["b", "a"], ["bfloat16", "float32"], [[2, 3], [4]])


def test_the_learner_pushes_and_falls_back_to_the_disk(engines, models, tmp_path):
    """The learner actor's side with a real Learner: a group that cannot be set up leaves it on the disk path; a
    push reaches both engines (its tensors are the ones the engine accepts); a push an engine refuses is written to
    disk and announced with its path instead, and the group is given up."""
    a, b, _ = engines
    learner = Learner(models[1], StageSettings(initial_version=20))
    actor = LearnerActor("learner", LearnerSettings(weight_sync="distributed", sync_timeout_s=60),
                         ActorContext(run_dir=tmp_path))
    actor.learner = InProcess()
    actor.learner.learner = learner
    actor.model_dir, actor.vocab = Path(models[1]), load_vocab_table(Path(models[1]))
    actor.out = {name: Output(f"learner.{name}", None) for name in ("updates", "metrics")}
    send, updates = anyio.create_memory_object_stream(10)
    actor.out["updates"].connect(send)

    async def main():
        async with HttpEngine(a, control_urls=[a, b]) as fleet:
            await actor._join(EngineReady(servers=["http://127.0.0.1:9"]))  # nothing listens there
            assert actor.pusher is None
            await actor._join(EngineReady(servers=[a, b]))
            assert actor.pusher is not None
            assert await actor._publish(1, {}, []) is None
            first = updates.receive_nowait()
            assert (first.version, first.pushed, first.weights_path) == (20, True, "")
            assert await fleet.worker_versions() == {a: "20", b: "20"}
            # a real refusal: b already has a weight-update session open, so it refuses the next one
            async with aiohttp.ClientSession() as s, s.post(f"{b}/begin_weight_update", json={}) as r:
                assert r.status == 200
            learner.version = 21
            path = await actor._publish(2, {}, [])
            second = updates.receive_nowait()
            assert (second.version, second.pushed, second.weights_path) == (21, False, str(path))
            assert actor.pusher is None and (path / "model.safetensors").is_file()
            assert await fleet.worker_versions() == {a: "20", b: "20"}  # neither moved: they still agree
            await fleet.update_weights(second.weights_path, 21)  # what the proxy does with the announcement
            assert await fleet.worker_versions() == {a: "21", b: "21"}

    try:
        run(main)
    finally:
        run(actor._stop_pushing)
