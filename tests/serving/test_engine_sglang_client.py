"""HttpEngine against a fake SGLang that answers exactly the JSON of SGLang's documented native API."""

from __future__ import annotations

import json

import anyio
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.messages import VersionSpan
from pipeline.serving.engine import (
    EngineBadRequest,
    EngineProtocolError,
    EngineSampling,
    EngineUnavailable,
    EngineVersionMismatch,
)
from pipeline.serving.launch import attach, free_port
from pipeline.serving.sglang_client import HttpEngine, parse_generate

DOC_STOP = {
    "text": "…",
    "output_ids": [785, 4226, 151645],
    "meta_info": {
        "id": "roll-7f3a-0",
        "finish_reason": {"type": "stop", "matched": 151645},
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "weight_version": "step_17",
        "num_retractions": 0,
        "output_token_logprobs": [[-0.12, 785, None], [-1.31, 4226, None], [-0.01, 151645, None]],
        "weight_versions": [{"version": "step_17", "start": 0, "end": 3}],
    },
}


def with_meta(base: dict, **meta) -> dict:
    return {**base, "meta_info": {**base["meta_info"], **meta}}


class FakeSGLang:
    """Records every request; /generate answers from ``replies`` keyed by rid."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.replies: dict[str, tuple[int, object]] = {}
        self.versions: dict[int, str] = {}  # by port: each server holds its own weights
        self.refuse: set[int] = set()  # ports that answer a weight update with a 500
        self.stale: set[int] = set()  # ports that answer a weight update with success but keep their weights

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        body = await request.json() if request.can_read_body else None
        self.calls.append((path, body))
        if path == "/health":
            return web.Response()
        port = request.url.port
        if path == "/model_info":
            return web.json_response({"model_path": "/ckpt/base", "is_generation": True,
                                      "weight_version": self.versions.get(port, "0")})
        if path == "/generate":
            status, reply = self.replies[body["rid"]]
            return web.Response(status=status, text=reply if isinstance(reply, str) else json.dumps(reply))
        if path == "/update_weights_from_disk":
            if port in self.refuse:
                return web.Response(status=500, text="CUDA error: out of memory")
            ok = body["model_path"] != "/bad"
            if ok and port not in self.stale:
                self.versions[port] = body["weight_version"]
            return web.json_response(
                {"success": ok, "message": "" if ok else "no such checkpoint"}, status=200 if ok else 400
            )
        return web.json_response({})


async def serve(fake: FakeSGLang, n: int = 1) -> tuple[web.AppRunner, list[str]]:
    runner = web.AppRunner(fake.app())
    await runner.setup()
    urls = []
    for _ in range(n):
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        urls.append(f"http://127.0.0.1:{port}")
    return runner, urls


def run_with_fake(fn, replies: dict, n_servers: int = 1):
    fake = FakeSGLang()
    fake.replies = replies

    async def main():
        runner, urls = await serve(fake, n_servers)
        try:
            async with HttpEngine(urls[0], control_urls=urls if n_servers > 1 else None) as c:
                return await fn(c, urls)
        finally:
            await runner.cleanup()

    return anyio.run(main), fake


def test_documented_stop_response_and_request_shape():
    s = EngineSampling(temperature=0.7, top_p=0.95, top_k=40, max_new_tokens=1024, stop_token_ids=(151645,), seed=3)
    res, fake = run_with_fake(
        lambda c, _: c.generate([151644, 872, 198, 3838], s, rid="roll-7f3a-0"),
        {"roll-7f3a-0": (200, DOC_STOP)},
    )
    assert res.output_ids == [785, 4226, 151645] and res.logprobs == [-0.12, -1.31, -0.01]
    assert res.finish_reason == "stop" and res.matched_stop == 151645
    assert res.weight_version == "step_17" and res.version_spans == [(0, "step_17")]
    assert res.prompt_tokens == 4 and res.completion_tokens == 3
    with pytest.raises(EngineProtocolError, match="not an integer"):
        res.spans()
    [(path, body)] = fake.calls
    assert path == "/generate"
    assert body == {
        "rid": "roll-7f3a-0",
        "input_ids": [151644, 872, 198, 3838],
        "sampling_params": {
            "max_new_tokens": 1024,
            "temperature": 0.7,
            "top_p": 0.95,
            "top_k": 40,
            "stop_token_ids": [151645],
            "ignore_eos": False,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "no_stop_trim": True,
            "sampling_seed": 3,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "stream": False,
    }


def test_length_and_abort_finishes_and_integer_versions():
    length = with_meta(DOC_STOP, finish_reason={"type": "length", "length": 3}, weight_version="12",
                       weight_versions=[{"version": "12", "start": 0, "end": 3}])
    abort = with_meta(
        DOC_STOP,
        finish_reason={"type": "abort", "message": "Abort before prefill"},
        weight_version="12",
        weight_versions=[{"version": "12", "start": 0, "end": 0}],  # SGLang's span for an empty output
        output_token_logprobs=[],
        completion_tokens=0,
    )
    abort["output_ids"] = []

    async def go(c, _):
        return await c.generate([1], EngineSampling(), rid="len"), await c.generate([1], EngineSampling(), rid="ab")

    (r_len, r_ab), _ = run_with_fake(go, {"len": (200, length), "ab": (200, abort)})
    assert r_len.finish_reason == "length" and r_len.matched_stop is None
    assert r_len.spans() == [VersionSpan(start=0, version=12)]
    assert r_ab.finish_reason == "abort" and r_ab.output_ids == [] and r_ab.version_spans == []


def test_meta_info_drift_is_tolerated():
    # no output_ids (ids only inside the logprob entries), two-element entries, string finish_reason,
    # no weight_version, extra unknown keys
    drift = {
        "text": "x",
        "meta_info": {
            "id": "d",
            "finish_reason": "stop",
            "new_key": {"a": 1},
            "output_token_logprobs": [[-0.5, 7], [-0.25, 8]],
        },
    }
    res, _ = run_with_fake(lambda c, _: c.generate([1, 2], EngineSampling(), rid="d"), {"d": (200, drift)})
    assert res.output_ids == [7, 8] and res.logprobs == [-0.5, -0.25] and res.finish_reason == "stop"
    assert res.weight_version == "" and res.version_spans == [] and res.prompt_tokens == 2


def test_errors_are_classified():
    bad = {"object": "error", "message": "Unknown sampling parameter foo", "code": 400}
    no_logprobs = {"output_ids": [1], "meta_info": {"id": "n", "finish_reason": {"type": "stop"}}}
    mismatch = with_meta(DOC_STOP)
    mismatch["output_ids"] = [1, 2, 3]

    async def go(c, _):
        out = []
        for rid in ("bad", "boom", "nolp", "mis", "notjson"):
            try:
                await c.generate([1], EngineSampling(), rid=rid)
            except Exception as e:  # noqa: BLE001 - collecting the classes is the point
                out.append((type(e), str(e)))
        dead = HttpEngine(f"http://127.0.0.1:{free_port()}")
        try:
            await dead.generate([1], EngineSampling())
        except EngineUnavailable as e:
            out.append((type(e), str(e)))
        healthy = await dead.health()
        await dead.aclose()
        return out, healthy

    (out, healthy), _ = run_with_fake(
        go,
        {
            "bad": (400, bad),
            "boom": (500, "Internal Server Error"),
            "nolp": (200, no_logprobs),
            "mis": (200, mismatch),
            "notjson": (200, "<html>"),
        },
    )
    kinds = [k for k, _ in out]
    assert kinds == [
        EngineBadRequest,
        EngineUnavailable,
        EngineProtocolError,
        EngineProtocolError,
        EngineProtocolError,
        EngineUnavailable,
    ]
    assert "Unknown sampling parameter foo" in out[0][1] and "HTTP 500" in out[1][1]
    assert not healthy


def test_control_calls_reach_every_worker():
    async def go(c, urls):
        await c.update_weights("/ckpt/step_17", 17)
        await c.pause("retract")
        await c.resume()
        await c.abort("r1")
        await c.abort()
        with pytest.raises(EngineBadRequest, match="no such checkpoint"):
            await c.update_weights("/bad", 18)
        return await c.health(), await c.model_info(), await c.worker_versions()

    (healthy, info, versions), fake = run_with_fake(go, {}, n_servers=2)
    assert healthy and info["model_path"] == "/ckpt/base"
    assert list(versions.values()) == ["17", "17"]  # both refused the bad checkpoint: they still agree
    control = [(p, b) for p, b in fake.calls if p not in ("/health", "/model_info")]
    expected = [
        (
            "/update_weights_from_disk",
            {"model_path": "/ckpt/step_17", "weight_version": "17", "abort_all_requests": False},
        ),
        ("/pause_generation", {"mode": "retract"}),
        ("/continue_generation", {}),
        ("/abort_request", {"rid": "r1"}),
        ("/abort_request", {"abort_all": True}),
        ("/update_weights_from_disk", {"model_path": "/bad", "weight_version": "18", "abort_all_requests": False}),
    ]
    assert control == [c for c in expected for _ in range(2)]  # every call reached both workers


def test_an_update_that_reaches_only_some_workers_fails_naming_each_version():
    """Worker 2 fails the update with a 500 (asked twice: one retry); worker 3 answers success but keeps its
    weights. The update must fail, saying who holds what, never return as if the fleet had moved."""
    async def go(c, urls):
        fake = c.fake
        fake.refuse.add(int(urls[1].rsplit(":", 1)[1]))
        with pytest.raises(EngineVersionMismatch) as failed:
            await c.update_weights("/ckpt/step_3", 3)
        fake.refuse.clear()
        fake.stale.add(int(urls[2].rsplit(":", 1)[1]))
        with pytest.raises(EngineVersionMismatch) as stale:
            await c.update_weights("/ckpt/step_4", 4)
        return urls, str(failed.value), str(stale.value)

    fake = FakeSGLang()

    async def main():
        runner, urls = await serve(fake, 3)
        try:
            async with HttpEngine(urls[0], control_urls=urls) as c:
                c.fake = fake  # type: ignore[attr-defined]
                return await go(c, urls)
        finally:
            await runner.cleanup()

    urls, failed, stale = anyio.run(main)
    assert f"{urls[1]}/update_weights_from_disk: HTTP 500: CUDA error: out of memory" in failed
    assert f"{urls[0]} -> '3', {urls[1]} -> '0', {urls[2]} -> '3'" in failed
    tries = [b for p, b in fake.calls if p == "/update_weights_from_disk" and b["weight_version"] == "3"]
    assert len(tries) == 4  # three workers, the failing one asked again once
    assert f"{urls[2]} answered success but reports version '3'" in stale
    assert f"{urls[0]} -> '4', {urls[1]} -> '4', {urls[2]} -> '3'" in stale


def test_unfinished_chunks_parse_when_allowed():
    meta = DOC_STOP["meta_info"]
    chunks = []
    for n in (1, 2, 3):
        chunks.append(
            {
                "text": "",
                "output_ids": DOC_STOP["output_ids"][:n],
                "meta_info": {
                    # as in SGLang, only the finished chunk carries the weight-version spans
                    **{k: v for k, v in meta.items() if n == 3 or k != "weight_versions"},
                    "finish_reason": meta["finish_reason"] if n == 3 else None,
                    "output_token_logprobs": meta["output_token_logprobs"][:n],
                },
            }
        )

    snaps = [parse_generate(c, "s", require_finish=False) for c in chunks]
    assert [s.output_ids for s in snaps] == [[785], [785, 4226], [785, 4226, 151645]]
    assert [s.version_spans for s in snaps] == [[(0, "step_17")]] * 3
    assert [s.finished for s in snaps] == [False, False, True] and snaps[-1].matched_stop == 151645
    with pytest.raises(EngineProtocolError, match="without finish_reason"):
        parse_generate(chunks[0], "s")


def test_attach_waits_for_a_running_server():
    fake = FakeSGLang()

    async def main():
        runner, urls = await serve(fake, 2)
        try:
            async with attach(urls[0], worker_urls=urls[1:], timeout_s=5) as c:
                return c.control_urls
        finally:
            await runner.cleanup()

    assert anyio.run(main)[0].startswith("http://127.0.0.1:")


def test_attach_refuses_workers_on_different_versions():
    fake = FakeSGLang()

    async def main():
        runner, urls = await serve(fake, 3)
        fake.versions[int(urls[2].rsplit(":", 1)[1])] = "7"
        try:
            async with attach(urls[0], worker_urls=urls[1:], timeout_s=5):
                pass
        finally:
            await runner.cleanup()

    with pytest.raises(EngineVersionMismatch, match=r"different weight versions: .* -> '0', .* -> '7'"):
        anyio.run(main)


def test_sampling_seed_is_sent_only_when_set():
    s = EngineSampling(temperature=0.6, top_k=20, max_new_tokens=77, stop_token_ids=(151645,), seed=4).to_sglang()
    assert s["stop_token_ids"] == [151645] and s["max_new_tokens"] == 77 and s["sampling_seed"] == 4
    assert "sampling_seed" not in EngineSampling().to_sglang()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 151_935), st.floats(-50, 0, allow_nan=False)), max_size=30),
    st.sampled_from(
        [
            {"type": "length", "length": 5},
            {"type": "abort"},
            {"type": "stop", "matched": 151645},
            {"type": "stop", "matched": "</s>"},
        ]
    ),
    st.booleans(),
    st.sets(st.integers(1, 29), max_size=4),
)
def test_parse_roundtrip(pairs, finish, with_ids, cuts):
    """Random outputs, finishes and weight updates at random token indices (SGLang 0.5.23's span format)."""
    n = len(pairs)
    starts = [0, *sorted(c for c in cuts if c < n)]
    ends = [*starts[1:], n]
    obj = {
        "meta_info": {
            "id": "x",
            "finish_reason": finish,
            "weight_version": str(2 + len(starts)),
            "weight_versions": [{"version": str(3 + i), "start": a, "end": b}
                                for i, (a, b) in enumerate(zip(starts, ends, strict=True))],
            "output_token_logprobs": [[lp, t, None] for t, lp in pairs],
        }
    }
    if with_ids:
        obj["output_ids"] = [t for t, _ in pairs]
    res = parse_generate(obj, "x")
    assert res.output_ids == [t for t, _ in pairs] and res.logprobs == [lp for _, lp in pairs]
    assert res.finish_reason == finish["type"]
    assert res.matched_stop == (finish["matched"] if isinstance(finish.get("matched"), int) else None)
    assert res.version_spans == ([(s, str(3 + i)) for i, s in enumerate(starts)] if pairs else [])
    assert res.spans() == ([VersionSpan(s, 3 + i) for i, s in enumerate(starts)] if pairs else [])
