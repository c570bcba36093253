"""What :class:`HttpEngine` really sends to SGLang and reads of its answers: every public call made against a
recording server, and every JSON answer handed to the client as an object that records the keys it looks at. Also
the embedded engine's answers in a chosen state, without a model."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch
from aiohttp import web

from pipeline.messages import VersionSpan
from pipeline.serving import sglang_api as api
from pipeline.serving.embedded.batcher import Req
from pipeline.serving.engine import EngineBadRequest, EngineSampling
from pipeline.serving.launch import free_port
from pipeline.serving.sglang_client import HttpEngine

EVERY_KEY = "*every key*"


class Tracked(dict):
    """A JSON object that records which of its keys the client looked at, as (where it sits, key)."""

    def __init__(self, obj: dict, path: str, reads: set[tuple[str, str]]) -> None:
        super().__init__({k: track(v, f"{path}.{k}" if path else k, reads) for k, v in obj.items()})
        self._path, self._reads = path, reads

    def __getitem__(self, key: str) -> Any:
        self._reads.add((self._path, key))
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self._reads.add((self._path, key))
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self._reads.add((self._path, str(key)))
        return super().__contains__(key)

    # reading every key (iterating) is recorded as such: the client must name what it reads
    def __iter__(self):
        self._reads.add((self._path, EVERY_KEY))
        return super().__iter__()

    def items(self):
        self._reads.add((self._path, EVERY_KEY))
        return super().items()

    def values(self):
        self._reads.add((self._path, EVERY_KEY))
        return super().values()


def track(obj: Any, path: str, reads: set[tuple[str, str]]) -> Any:
    if isinstance(obj, dict):
        return Tracked(obj, path, reads)
    if isinstance(obj, list):
        return [track(x, f"{path}[]", reads) for x in obj]
    return obj


# A finished /generate answer with more meta_info keys than the client needs (as SGLang 0.5.23 sends them), and
# a weight update after the first token.
GENERATE_ANSWER = {
    "text": "ab",
    "output_ids": [7, 8, 9],
    "meta_info": {
        "id": "g",
        "finish_reason": {"type": "stop", "matched": 9},
        "prompt_tokens": 2,
        "completion_tokens": 3,
        "cached_tokens": 0,
        "reasoning_tokens": 0,
        "num_retractions": 0,
        "e2e_latency": 0.1,
        "weight_version": "4",
        "weight_versions": [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}],
        "output_token_logprobs": [[-0.1, 7, None], [-0.2, 8, None], [-0.3, 9, None]],
        "output_token_logprobs_length": 3,
    },
}


class Recorder:
    """Records (method, path, JSON body or None) of every request and answers like SGLang."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.version = "4"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        self.calls.append((request.method, request.path, body))
        if request.path == "/generate":
            meta = {**GENERATE_ANSWER["meta_info"], "id": body["rid"]}
            return web.json_response({**GENERATE_ANSWER, "meta_info": meta})
        if request.path == "/update_weights_from_disk":
            ok = body["model_path"] != "/refused"  # SGLang says 400 to a refused update; the client reads 200s too
            if ok:
                self.version = body["weight_version"]
            return web.json_response({"success": ok, "message": "ok" if ok else "refused", "num_paused_requests": 0})
        if request.path in api.SYNC_CALLS:
            if request.path == "/update_weights_from_distributed":
                self.version = body["weight_version"]
            return web.json_response({"success": True, "message": "ok"})
        if request.path in ("/model_info", "/server_info"):
            return web.json_response({"model_path": "/m", "weight_version": self.version})
        return web.json_response({"message": "ok", "status": "ok"}) if request.method == "POST" else web.Response()


def record_client(monkeypatch: pytest.MonkeyPatch) -> tuple[list[tuple[str, str, Any]], set[tuple[str, str]], set[str]]:
    """Make every public HttpEngine call (every sampling option, every pause mode, both abort forms, a refused
    update) against a :class:`Recorder`. Returns (the requests, the answer keys the client read as (path, key) with
    path "" for the /generate answer and the endpoint for the others, the names of the calls made)."""
    reads: set[tuple[str, str]] = set()
    check = HttpEngine._check

    def tracked_check(url: str, status: int, raw: bytes) -> Any:
        path = url.split("/", 3)[3]
        return track(check(url, status, raw), "" if path == "generate" else f"/{path}", reads)

    monkeypatch.setattr(HttpEngine, "_check", staticmethod(tracked_check))
    rec = Recorder()
    made: set[str] = set()

    async def main():
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", rec.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with HttpEngine(f"http://127.0.0.1:{port}") as c:
                full = EngineSampling(temperature=0.5, top_p=0.9, top_k=5, max_new_tokens=3, stop_token_ids=(9,),
                                      ignore_eos=True, seed=1)
                res = await c.generate([1, 2], full, rid="g1")
                assert res.spans() == [VersionSpan(0, 3), VersionSpan(1, 4)]
                await c.generate([1, 2], EngineSampling())
                await c.update_weights("/ckpt", 4)
                await c.update_weights("/ckpt", 5, abort_all_requests=True)
                with pytest.raises(EngineBadRequest, match="refused"):
                    await c.update_weights("/refused", 6)
                for mode in sorted(api.PAUSE_MODES):
                    await c.pause(mode)  # type: ignore[arg-type]
                await c.resume()
                await c.abort("g1")
                await c.abort()
                assert await c.health()
                await c.model_info()
                await c.server_info()
                assert await c.worker_versions() == {c.base_url: "5"} and await c.check_versions() == "5"
                # weight sync without the disk: no process group behind the recorder, so nothing to broadcast
                await c.init_weights_update_group("127.0.0.1", 29500, anyio.lowlevel.checkpoint, backend="gloo",
                                                  group_name="weight_update_group")
                await c.update_weights_from_distributed(["w"], ["bfloat16"], [[2, 3]], 6, anyio.lowlevel.checkpoint,
                                                        group_name="weight_update_group")
                await c.destroy_weights_update_group("weight_update_group")
                made.update({"generate", "update_weights", "pause", "resume", "abort", "health", "model_info",
                             "server_info", "worker_versions", "check_versions", "init_weights_update_group",
                             "update_weights_from_distributed", "destroy_weights_update_group"})
        finally:
            await runner.cleanup()

    anyio.run(main)
    return rec.calls, reads, made


def embedded_answer(n: int, spans: list[tuple[int, str]], finish: dict | None, version: str = "5") -> dict[str, Any]:
    """The embedded engine's /generate answer for a request with ``n`` output tokens whose versions changed at
    ``spans``, finished with ``finish`` (None: a streamed chunk), the engine being at ``version``."""
    r = Req(rid="e", prompt=[1, 2], max_new_tokens=10, temperature=1.0, top_p=1.0, top_k=-1, stop_ids=frozenset(),
            ignore_eos=False, return_logprob=True, stream=True, generator=torch.Generator(),
            deliver=lambda payload, final: None)
    r.out_ids, r.logprobs, r.spans, r.finish = list(range(10, 10 + n)), [-1.0] * n, spans, finish
    return r.payload(version)
