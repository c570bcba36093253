#!/usr/bin/env python3
"""A zero-latency engine for the proxy benchmark: an HTTP server on 127.0.0.1 that answers instantly.

    python benchmarks/_zero_engine.py [--port 0]      # prints "ENGINE-READY http://127.0.0.1:PORT" on stdout

It serves these endpoints with the same fixed answer ("OK" then <|im_end|>):

- ``POST /generate``: SGLang's native response shape (docs/serving.md), what bridle's proxy calls
  through :class:`pipeline.serving.sglang_client.HttpEngine`;
- ``POST /v1/chat/completions``: OpenAI-compatible, streamed as SSE when ``stream`` is true — the baseline the
  load client calls directly, and what LiteLLM forwards to;
- with ``--tokenize`` also ``POST /tokenize/v1/chat/completions``: the same answer after rendering the request
  with the Qwen3 chat template and tokenizing it (``pipeline.tokens.render.qwen3_renderer``), the work a real engine's
  OpenAI endpoint does for a direct chat call and that bridle does instead of the engine (it sends ids).

The plain handlers do the work a real server cannot avoid (read and parse the JSON body) and nothing else, so
"via a proxy minus direct" isolates the proxy. It runs in its own process so that load client, proxy and engine
never share an event loop. Without ``--tokenize`` only the standard library and aiohttp are imported (no pipeline
code, no tokenizer): the output ids are passed in by the benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time

from aiohttp import web

# Qwen tokenizer ids of "OK" and <|im_end|> (pipeline.tokens.tokenizer.QwenTokenizer().encode("OK<|im_end|>")).
DEFAULT_IDS = (3925, 151645)
DEFAULT_TEXT = "OK"


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def chat_stream_body(text: str, n_out: int, usage: bool, prompt_tokens: int = 0) -> bytes:
    """A whole streamed chat completion (role, content, finish, optional usage, [DONE]) as one SSE body."""
    base = {"id": "chatcmpl-zero", "object": "chat.completion.chunk", "created": int(time.time()), "model": "policy"}
    frames = [
        _sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}),
        _sse({**base, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}),
        _sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
    ]
    if usage:
        frames.append(_sse({**base, "choices": [], "usage": {
            "prompt_tokens": prompt_tokens, "completion_tokens": n_out, "total_tokens": prompt_tokens + n_out}}))
    frames.append(b"data: [DONE]\n\n")
    return b"".join(frames)


def chat_body(text: str, n_out: int) -> bytes:
    return json.dumps({
        "id": "chatcmpl-zero", "object": "chat.completion", "created": int(time.time()), "model": "policy",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 0, "completion_tokens": n_out, "total_tokens": n_out},
    }).encode()


def make_app(ids: tuple[int, ...] = DEFAULT_IDS, text: str = DEFAULT_TEXT, tokenize: bool = False) -> web.Application:
    stream_plain = chat_stream_body(text, len(ids), usage=False)
    stream_usage = chat_stream_body(text, len(ids), usage=True)
    plain = chat_body(text, len(ids))
    lp = [[-0.01, int(i), None] for i in ids]
    calls = {"generate": 0, "chat": 0}

    async def generate(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        calls["generate"] += 1
        out = {
            "text": text, "output_ids": list(ids),
            "meta_info": {
                "id": body.get("rid", ""), "finish_reason": {"type": "stop", "matched": ids[-1]},
                "prompt_tokens": len(body.get("input_ids", ())), "completion_tokens": len(ids),
                "weight_version": "0", "num_retractions": 0, "output_token_logprobs": lp,
            },
        }
        return web.Response(body=json.dumps(out).encode(), content_type="application/json")

    async def chat(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        calls["chat"] += 1
        if body.get("stream"):
            so = body.get("stream_options")
            usage = isinstance(so, dict) and bool(so.get("include_usage"))
            return web.Response(body=stream_usage if usage else stream_plain, content_type="text/event-stream",
                                headers={"Cache-Control": "no-cache"})
        return web.Response(body=plain, content_type="application/json")

    render = None
    if tokenize:
        from pipeline.tokens.from_wire import from_chat
        from pipeline.tokens.render import qwen3_renderer

        renderer = qwen3_renderer()

        def render(body: dict) -> int:
            # what SGLang's OpenAI endpoint does before it schedules: chat template + tokenization
            return len(renderer.render_ids(from_chat(body)))

    async def chat_tokenize(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        assert render is not None
        n_in = render(body)
        calls["chat"] += 1
        if body.get("stream"):
            so = body.get("stream_options")
            usage = isinstance(so, dict) and bool(so.get("include_usage"))
            payload = chat_stream_body(text, len(ids), usage=usage, prompt_tokens=n_in)
            return web.Response(body=payload, content_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return web.Response(body=plain, content_type="application/json")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "zero"}]})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True, **calls})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/chat/completions", chat)
    if tokenize:
        app.router.add_post("/tokenize/v1/chat/completions", chat_tokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


async def serve(port: int, ids: tuple[int, ...], text: str, tokenize: bool) -> None:
    runner = web.AppRunner(make_app(ids, text, tokenize), access_log=None, handle_signals=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=1024)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"ENGINE-READY http://127.0.0.1:{bound}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--ids", type=int, nargs="+", default=list(DEFAULT_IDS), help="output ids, stop token last")
    ap.add_argument("--text", default=DEFAULT_TEXT, help="the text those ids decode to (without the stop token)")
    ap.add_argument("--tokenize", action="store_true",
                    help="also serve /tokenize/v1/chat/completions (renders + tokenizes; needs bridle importable)")
    args = ap.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.port, tuple(args.ids), args.text, args.tokenize))


if __name__ == "__main__":
    main()
