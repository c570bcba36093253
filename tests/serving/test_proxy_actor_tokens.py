"""The proxy actor revokes a rollout's token when the collector says the rollout settled: a harness (or anything it
left running in its sandbox) that calls again afterwards is refused, by the actor's own proxy or by the proxy
worker that owns the rollout.
"""

from __future__ import annotations

import json

import aiohttp
import anyio
import pytest

from actors.proxy import ProxyActor
from pipeline.messages import RolloutRequest, ServiceReady
from pipeline.serving.factory import EngineSettings
from pipeline.serving.proxy import ProxySettings
from tests.helpers.live_actor import live
from tests.helpers.treegen import settled

pytestmark = pytest.mark.anyio


def _request(rid: str) -> RolloutRequest:
    return RolloutRequest(rollout_id=rid, group_id="g0", index=0, group_size=2, task_id="t0", harness="h",
                          token=f"tok-{rid}", policy_version=0)


async def _status(url: str, token: str) -> int:
    async with aiohttp.ClientSession() as s, s.post(
            url + "/v1/chat/completions", headers={"authorization": f"Bearer {token}"},
            json={"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}) as r:
        await r.read()
        return r.status


async def test_a_settled_rollouts_token_is_refused_and_the_others_still_served(tmp_path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"default": [{"text": "Done."}]}))
    cfg = ProxySettings(unix_socket="", engine=EngineSettings(kind="scripted", script=str(script)))
    actor = ProxyActor("proxy", cfg)
    async with live(actor) as lv:
        with anyio.fail_after(30):
            await actor.ready.wait()
        (ready,) = await lv.wait_for("rollouts", 1)
        assert isinstance(ready, ServiceReady)
        for i, rid in enumerate(("r0", "r1")):
            await lv.inbox.send(_request(rid))
            await lv.wait_for("rollouts", 2 + i)
        url = ready.base_url
        with anyio.fail_after(30):
            assert [await _status(url, "tok-r0"), await _status(url, "tok-r1")] == [200, 200]
            done = settled([], rid="r0")
            await lv.inbox.send(done)
            # the actor takes the message asynchronously: the revocation shows within a few polls
            for _ in range(100):
                if await _status(url, "tok-r0") == 401:
                    break
                await anyio.sleep(0.05)
            else:
                raise AssertionError("the settled rollout's token is still served after 100 polls")
            assert await _status(url, "tok-r1") == 200  # the other rollout is untouched
        lv.inbox.close()


@pytest.mark.slow
async def test_with_proxy_workers_a_settled_rollouts_token_is_refused_by_its_worker(tmp_path):
    """``[proxy] workers = 2``: the actor hands the settlement to the worker that owns the rollout. Workers need an
    HTTP engine (a tiny embedded one here); the rollouts are scripted, so no call reaches it."""
    import msgspec

    from pipeline.core.config import RunSection
    from pipeline.core.runtime import ActorContext
    from pipeline.models.quickstart import ModelSpec, ensure_model

    model = ensure_model(msgspec.convert({"path": str(tmp_path / "model"), "families": "create_word", "tasks": 20,
                                          "hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1},
                                         ModelSpec))
    cfg = ProxySettings(workers=2, engine=EngineSettings(kind="embedded"))
    ctx = ActorContext(run_dir=tmp_path, run=RunSection(model=str(model)))
    actor = ProxyActor("proxy", cfg, ctx)
    script = [{"text": "Done."}, {"text": "Done."}]
    async with live(actor) as lv:
        with anyio.fail_after(120):
            await actor.ready.wait()
        await lv.wait_for("rollouts", 1)  # ServiceReady
        routed = []
        for i, rid in enumerate(("r0", "r1")):
            await lv.inbox.send(msgspec.structs.replace(_request(rid), script=script))
            routed.append((await lv.wait_for("rollouts", 2 + i))[-1])
        assert sorted(r.proxy.worker for r in routed) == [0, 1]  # one rollout per worker
        r0, r1 = routed
        with anyio.fail_after(30):
            assert [await _status(r0.proxy.base_url, r0.token), await _status(r1.proxy.base_url, r1.token)] == [
                200, 200]
            await lv.inbox.send(settled([], rid="r0"))
            for _ in range(100):
                if await _status(r0.proxy.base_url, r0.token) == 401:
                    break
                await anyio.sleep(0.05)
            else:
                raise AssertionError("the settled rollout's token is still served by its worker after 100 polls")
            assert await _status(r1.proxy.base_url, r1.token) == 200
        lv.inbox.close()
