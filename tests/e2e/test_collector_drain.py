"""The collector at the end of a run: once its inputs close it still settles every finished rollout by its own
clock, then stops by itself (an unfinished rollout can no longer settle, so it does not wait for one)."""

from __future__ import annotations

import anyio
import pytest

from actors.collector import Collector
from pipeline.trees.collector import SettleSettings
from tests.helpers.live_actor import live
from tests.helpers.treegen import mc, settled

pytestmark = pytest.mark.anyio


async def test_inputs_closed_finished_rollouts_still_settle_then_it_stops():
    actor = Collector("collector", SettleSettings(settle_checks=3, settle_interval_s=0.1, settle_timeout_s=60.0))
    done = settled([mc(0, [1, 2], [3])], rid="r0")
    unfinished = settled([mc(0, [1, 2], [4])], rid="r1")
    async with live(actor) as lv:
        for msg in (done.request, *done.calls, done.finished, unfinished.request, *unfinished.calls):
            await lv.inbox.send(msg)
        await lv.inbox.aclose()
        assert lv.sent["settled"] == []  # three quiet checks 0.1 s apart still to come
        with anyio.fail_after(5):
            await lv.stopped.wait()
        assert [s.request.rollout_id for s in lv.sent["settled"]] == ["r0"]


async def test_inputs_closed_with_nothing_to_settle_it_stops_at_once():
    actor = Collector("collector", SettleSettings(settle_checks=3, settle_interval_s=10.0, settle_timeout_s=60.0))
    unfinished = settled([mc(0, [1, 2], [4])], rid="r1")
    async with live(actor) as lv:
        for msg in (unfinished.request, *unfinished.calls):
            await lv.inbox.send(msg)
        await lv.inbox.aclose()
        with anyio.fail_after(1):  # well before the first tick (0.25 s) could matter
            await lv.stopped.wait()
        assert lv.sent["settled"] == []
