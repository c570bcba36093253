"""The proxy actor revokes a rollout's token when the collector says the rollout settled: a harness (or anything it
left running in its sandbox) that calls again afterwards is refused. (Proxy workers forget a token the same way:
tests/serving/test_proxy_workers.py; they need an HTTP engine, which the scripted one is not.)
"""

from __future__ import annotations

import json

import aiohttp
import anyio
import pytest

from actors.proxy import ProxyActor, ProxyActorSettings
from pipeline.messages import RolloutRequest, ServiceReady
from pipeline.serving.factory import EngineSettings
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
    cfg = ProxyActorSettings(unix_socket="", engine=EngineSettings(kind="scripted", script=str(script)))
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
