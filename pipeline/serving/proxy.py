"""The capturing proxy: the model boundary every harness talks to (docs/architecture.md).

Per request: authenticate the rollout token → convert the body to the internal conversation → render to ids
with splicing (token-in) → ``engine.generate`` → parse the output once → answer in the harness's protocol
(buffered pseudo-SSE when a stream was asked for) → emit ``CallStarted`` and ``ModelCall`` (or ``CallFailed``).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/messages`` (``?beta=true`` too), ``POST
/v1/messages/count_tokens``, ``POST /v1/responses``, ``GET /v1/models``, ``HEAD /`` and ``GET /health``. The same
paths without ``/v1`` are accepted, since base-URL conventions differ between clients. The wire rules the answers
follow are in docs/wire-protocols.md.

Errors are answered in the protocol of the endpoint, with ``x-should-retry: false`` where retrying cannot help, so a
broken request or engine never turns into a retry storm (every retry would be a dead leaf in the tree). Reading and
refusing a request: harness_request.py; the engine call, its retries and errors: engine_call.py; when the answer's
bytes go out: streaming.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import anyio
import msgspec
import orjson

from pipeline.core.config import ConfigError, NonNegFloat, NonNegInt, Port, PosFloat, PosInt, Section
from pipeline.core.logs import get_logger
from pipeline.messages import (
    CallFailed,
    CallStarted,
    CallTimings,
    Message,
    ModelCall,
    RolloutRequest,
    SamplingParams,
    pack_f32,
    pack_i32,
    rollout_token,
)
from pipeline.serving.engine import Engine, EngineSampling
from pipeline.serving.engine_call import result_versions, run_engine
from pipeline.serving.factory import EngineSettings, engine_problem, renderer_problem
from pipeline.serving.harness_request import (
    ProxyError,
    convert,
    error_response,
    include_usage,
    read_body,
    request_token,
)
from pipeline.serving.http_server import HttpServer, Request, Response, Stream, json_response
from pipeline.serving.labels import detect_label
from pipeline.serving.scripted import Script, ScriptedEngine, ScriptResponse
from pipeline.serving.streaming import finish_stream, watch_engine
from pipeline.serving.teacher import api_key_from
from pipeline.serving.trace import call_trace
from pipeline.serving.wire import PROTOCOLS, ErrorKind, Protocol, Reply, StreamState
from pipeline.tokens.conversation import Conversation
from pipeline.tokens.render import Renderer
from pipeline.tokens.splice import RenderPlan, RenderResult, Splicer

Emit = Callable[[Message], Awaitable[None]]


class ProxySettings(Section):
    """``[proxy]`` (and its table ``[proxy.engine]``, the engine that serves ``[run].model``)."""

    host: str = "127.0.0.1"  # the address it listens on (0.0.0.0: every interface)
    port: Port = 0  # 0: pick a free port
    # also listen on this Unix socket (Docker sandboxes reach the proxy through it, mounted); "auto": one in a
    # fresh temp folder (a socket path must stay under 108 bytes); "": TCP only
    unix_socket: str = "auto"
    keepalive_s: Annotated[float, msgspec.Meta(gt=0, le=15)] = 5.0  # SSE heartbeat; harnesses give up after ~15 s
    # A stream's head (200, SSE headers, opening events) goes out once the engine has worked this long: a faster
    # answer goes out whole in one write; anything slower gets its head within 20 ms, which no client can tell
    # from "at once" (wire rules §4). 0 sends the head before waiting on the engine at all.
    stream_head_s: NonNegFloat = 0.02
    max_body_bytes: PosInt = 32 << 20  # a larger request is refused
    # What one client can hold (pipeline/serving/http_server.py; docs/serving.md): a sandbox is a client, and its
    # policy may be hostile. A request arrives whole within request_timeout_s; at most max_connections are open;
    # one rollout's token holds at most max_connections_per_token requests at once.
    request_timeout_s: PosFloat = 60.0
    max_connections: PosInt = 1024  # open at once, all clients
    max_connections_per_token: PosInt = 64  # requests one rollout's token holds at once
    context_len: PosInt = 32768  # prompt + output must fit; longer prompts get a context-length error
    model_name: str = "policy"  # the model id answers carry
    subagent_model: str = "policy-subagent"  # a model id harnesses are told to use for subagents
    # A call with at least this many characters of new prompt text (not covered by the splicer's prefix cache)
    # is tokenized in a worker thread, so the event loop keeps serving other calls meanwhile (the tokenizer
    # releases the GIL); shorter ones are tokenized inline. A hop costs ~0.1 ms of CPU and makes the tokenization
    # itself ~0.25 ms slower (measured at 2k tokens), so it pays only for long texts and with a core to spare:
    # 32k characters is ~8k tokens, ~2 ms of tokenizing. 0 tokenizes every call inline.
    render_thread_chars: NonNegInt = 32768
    render_threads: PosInt = 2  # worker threads for that
    # An engine that fails or cannot be reached (not one that refuses the request) is asked again this many times,
    # ENGINE_RETRY_S apart, before the harness is told: a transient failure then costs the rollout nothing,
    # whatever the harness does with errors (Codex and Qwen Code end the rollout at the first one). A dead engine
    # is the watchdog's (pipeline/serving/watchdog.py).
    engine_retries: NonNegInt = 1
    update_timeout_s: PosFloat = 600.0  # a weight update the engine has not applied by then fails the run
    # proxy processes, each owning the rollouts routed to it: one event loop tops out at ~1,000 fresh 2k-token
    # calls/s (docs/serving.md, "Proxy workers"); 1 serves in this process
    workers: PosInt = 1
    # before serving: is turn-by-turn rendering with splicing the template's own rendering (docs/tokens.md)?
    # "error" refuses to start on a mismatch, "warn" logs it and serves, "off" skips the check
    template_check: Literal["error", "warn", "off"] = "error"
    engine: EngineSettings = msgspec.field(default_factory=EngineSettings)  # [proxy.engine]
    reloadable = frozenset({"keepalive_s", "update_timeout_s"})

    def check(self, name: str, exp: Any) -> None:
        if self.engine.kind == "openai":
            if not self.engine.url or not self.engine.served_model:
                raise ConfigError(f'{exp.source}: [{name}.engine] kind = "openai" needs url (the endpoint\'s base URL, '
                                  "e.g. http://host:8000/v1) and served_model (the model name it serves)")
            try:
                api_key_from(self.engine.api_key_env)
            except ValueError as e:
                raise ConfigError(f"{exp.source}: {str(e).replace('[proxy.engine]', f'[{name}.engine]')}") from None
            learner = exp.kind_section("learner")
            if learner is not None:
                raise ConfigError(
                    f'{exp.source}: [{name}.engine].kind = "openai" (a teacher behind another endpoint) with '
                    f"[{learner[0]}] in the graph: the teacher's samples are not the policy's, so nothing may train on "
                    "them as they are sampled. Record the teacher with run.py --eval (or --serve), then learn from "
                    "the recording in another run: [scheduler].sft_recordings")
        elif self.engine.kind != "scripted" and not exp.run.model:
            raise ConfigError(f'{exp.source}: [run].model: the {self.engine.kind} engine ([{name}.engine].kind) '
                              "serves the policy in this HF folder; set it")
        if self.engine.context_len and self.engine.context_len < self.context_len:
            raise ConfigError(f"{exp.source}: [{name}].context_len = {self.context_len} admits prompts the engine "
                              f"cannot hold: [{name}.engine].context_len = {self.engine.context_len}; make the "
                              f"proxy's at most the engine's")
        for problem in (engine_problem(self.engine), renderer_problem(self.engine, exp.run.model)):
            if problem:
                raise ConfigError(f"{exp.source}: {problem.replace('[engine]', f'[{name}.engine]')}")
        if self.workers > 1:
            if self.engine.kind in ("scripted", "openai"):
                raise ConfigError(f"{exp.source}: [{name}].workers = {self.workers}: the {self.engine.kind} engine "
                                  "lives in the proxy's process, which workers cannot reach; use workers = 1 with it")
            sandbox = exp.kind_section("sandbox")
            if (sandbox is not None and getattr(sandbox[1], "backend", "") == "ray"
                    and sandbox[1].ray.proxy_address):
                raise ConfigError(f"{exp.source}: [{name}].workers = {self.workers} with [{sandbox[0]}.ray] "
                                  f"proxy_address = {sandbox[1].ray.proxy_address!r}: that is one host:port, and each "
                                  f"worker listens on its own ([{name}] port + its index); leave proxy_address empty "
                                  f"and set [{name}] host to an address the Ray nodes reach")


@dataclass
class RolloutState:
    request: RolloutRequest
    splicer: Splicer
    seq: int = 0
    pending: set[str] = field(default_factory=set)
    calls: int = 0
    # one render of this rollout's Splicer at a time (a render may run in a worker thread; parallel calls of one
    # rollout, e.g. subagents, would otherwise render concurrently)
    render_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(slots=True)
class _Call:
    """One harness call on its way through the proxy: where it came from and what its answer needs."""

    request: Request
    proto: Protocol
    conv: Conversation
    st: RolloutState
    call_id: str
    seq: int
    label: str
    model: str  # the model name the answer carries
    received: float
    ctx: dict[str, Any]  # log context, bound only when something is logged
    stream: bool
    sstate: StreamState


class Proxy:
    """The HTTP side. ``emit`` receives CallStarted / ModelCall / CallFailed (the actor forwards them)."""

    def __init__(self, engine: Engine, renderer: Renderer, emit: Emit, settings: ProxySettings | None = None):
        self.engine = engine
        self.renderer = renderer
        self.emit = emit
        self.settings = settings or ProxySettings()
        self.rollouts: dict[str, RolloutState] = {}  # token -> state
        self.by_id: dict[str, str] = {}  # rollout id -> token
        self.policy_version = 0
        self.log = get_logger(actor="proxy")
        self._stdlog = logging.getLogger("bridle")  # what get_logger's records go through (level checks)
        self._render_limiter: anyio.CapacityLimiter | None = None
        self.server: HttpServer | None = None
        self.base_url = ""
        self.unix_socket = ""
        self._socket_dir = ""  # made for unix_socket = "auto"; removed by stop()
        self.render_seconds = 0.0
        self.scripted: ScriptedEngine | None = None

    # --------------------------------------------------------------------------------- rollout registry
    def register(self, req: RolloutRequest) -> None:
        if req.script:
            self._scripted().script.rollouts[req.rollout_id] = msgspec.convert(req.script, list[ScriptResponse])
        self.rollouts[req.token] = RolloutState(req, Splicer(self.renderer))
        self.by_id[req.rollout_id] = req.token

    def _scripted(self) -> ScriptedEngine:
        """The in-process engine that plays scripted rollouts (oracle demonstrations) next to the policy."""
        if self.scripted is None:
            self.scripted = ScriptedEngine(self.renderer, Script(), weight_version=self.policy_version)
        return self.scripted

    def engine_for(self, st: RolloutState) -> Engine:
        return self._scripted() if st.request.script else self.engine

    def open_rollout(self, rollout_id: str, sampling: SamplingParams | None = None) -> str:
        """Register a rollout by hand (``--serve``, tests) and return its fresh token."""
        token = rollout_token()
        self.register(RolloutRequest(
            rollout_id=rollout_id, group_id=rollout_id, index=0, group_size=1, task_id="", harness="manual",
            token=token, policy_version=self.policy_version, sampling=sampling or SamplingParams(),
        ))
        return token

    def forget(self, rollout_id: str) -> list[tuple[Engine, str]]:
        """Stop accepting the rollout's token; returns (engine, rid) of calls still in flight (to abort)."""
        token = self.by_id.pop(rollout_id, None)
        st = self.rollouts.pop(token, None) if token is not None else None
        if self.scripted is not None:
            self.scripted.script.rollouts.pop(rollout_id, None)
        if st is None:
            return []
        return [(self.engine_for(st), f"{rollout_id}|{c}") for c in st.pending]

    def pending(self, rollout_id: str) -> int:
        token = self.by_id.get(rollout_id)
        st = self.rollouts.get(token) if token else None
        return len(st.pending) if st else 0

    # ------------------------------------------------------------------------------------------- server
    def routes(self) -> dict[tuple[str, str], Callable[[Request], Awaitable[Response | Stream]]]:
        routes: dict[tuple[str, str], Callable[[Request], Awaitable[Response | Stream]]] = {
            ("HEAD", "/"): self.head, ("GET", "/health"): self.health}
        for prefix in ("/v1", ""):
            routes[("POST", prefix + "/chat/completions")] = self._handler("chat")
            routes[("POST", prefix + "/messages")] = self._handler("anthropic")
            routes[("POST", prefix + "/messages/count_tokens")] = self.count_tokens
            routes[("POST", prefix + "/responses")] = self._handler("responses")
            routes[("GET", prefix + "/models")] = self.models
            routes[("HEAD", prefix + "/models")] = self.models
        return routes

    async def start(self) -> str:
        self._render_limiter = anyio.CapacityLimiter(max(1, self.settings.render_threads))
        st = self.settings
        self.server = HttpServer(self.routes(), max_body_bytes=st.max_body_bytes,
                                 request_timeout_s=st.request_timeout_s, max_connections=st.max_connections,
                                 max_connections_per_token=st.max_connections_per_token)
        port = await self.server.listen_tcp(self.settings.host, self.settings.port)
        self.base_url = f"http://{self.settings.host}:{port}"
        sock = self.settings.unix_socket
        if sock == "auto":
            self._socket_dir = tempfile.mkdtemp(prefix="bridle.sock-")
            sock = os.path.join(self._socket_dir, "proxy.sock")
        if sock:
            await self.server.listen_unix(sock)
            await anyio.Path(sock).chmod(0o666)
            self.unix_socket = sock
        self.log.info("proxy listening", base_url=self.base_url, unix_socket=self.unix_socket or None)
        return self.base_url

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.close()
            self.server = None
        if self._socket_dir:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = ""

    async def head(self, request: Request) -> Response:
        return Response(200)

    async def health(self, request: Request) -> Response:
        return json_response({"ok": True, "rollouts": len(self.rollouts), "policy_version": self.policy_version})

    async def models(self, request: Request) -> Response:
        now = int(time.time())
        ids = [self.settings.model_name, self.settings.subagent_model]
        return json_response({
            "object": "list",
            "data": [{"id": i, "object": "model", "created": now, "owned_by": "bridle", "type": "model",
                      "display_name": i, "created_at": "1970-01-01T00:00:00Z"} for i in ids],
            "has_more": False, "first_id": ids[0], "last_id": ids[-1],
        })

    # -------------------------------------------------------------------------------------- helpers
    def _auth(self, request: Request) -> RolloutState:
        token = request_token(request)
        st = self.rollouts.get(token) if token else None
        if st is None:
            raise ProxyError("authentication",
                             "missing or unknown rollout token (send it as x-api-key or Authorization: Bearer)")
        return st

    async def count_tokens(self, request: Request) -> Response:
        proto = PROTOCOLS["anthropic"]
        try:
            self._auth(request)
            body = read_body(request, self.settings.max_body_bytes)
            body.setdefault("max_tokens", 1)
            conv = convert("anthropic", body)
            n = len(self.renderer.render_ids(conv))
        except ProxyError as e:
            return error_response(proto, e.kind, str(e))
        return json_response({"input_tokens": int(n)})

    def _handler(self, protocol: str) -> Callable[[Request], Awaitable[Response | Stream]]:
        async def handle(request: Request) -> Response | Stream:
            return await self.handle_call(protocol, request)

        return handle

    # ------------------------------------------------------------------------------------------- a call
    async def handle_call(self, protocol: str, request: Request) -> Response | Stream:
        proto = PROTOCOLS[protocol]
        received = time.time()
        try:
            st = self._auth(request)
            body = read_body(request, self.settings.max_body_bytes)
            conv = convert(protocol, body)
        except ProxyError as e:
            return error_response(proto, e.kind, str(e))
        req = st.request
        label = detect_label(protocol, request.headers, body, conv, self.settings.subagent_model)
        call_id = os.urandom(8).hex()
        seq = st.seq
        st.seq += 1
        # bound only when something is logged: binding costs more per call than the logging a call usually does
        ctx = {"rollout": req.rollout_id, "call": call_id, "seq": seq, "protocol": protocol, "label": label}

        try:
            rendered, render_s = await self._render(st, conv)
        except Exception as e:  # noqa: BLE001 — a conversation the template cannot render is the request's fault
            self.log.bind(**ctx).warning("render failed", error=repr(e))
            return error_response(proto, "invalid_request", f"cannot render this conversation: {e}")
        self.render_seconds += render_s
        input_ids = rendered.ids
        n_in = int(input_ids.shape[0])
        room = self.settings.context_len - n_in
        if room <= 0:
            return error_response(proto, "context_length",
                               f"prompt is {n_in} tokens; the context length is {self.settings.context_len}")
        sp = req.sampling
        asked = conv.sampling.max_tokens
        sampling = EngineSampling(
            temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
            max_new_tokens=max(1, min(sp.max_new_tokens, room, asked if asked else sp.max_new_tokens)),
            stop_token_ids=tuple(st.splicer.stop_ids),
            seed=None if sp.seed is None else sp.seed + seq,
        )

        model = conv.model or self.settings.model_name
        call = _Call(
            request=request, proto=proto, conv=conv, st=st, call_id=call_id, seq=seq, label=label, model=model,
            received=received, ctx=ctx, stream=bool(conv.sampling.stream),
            sstate=proto.new_state(model, n_in, include_usage=include_usage(body)),
        )
        st.pending.add(call_id)
        await self.emit(CallStarted(rollout_id=req.rollout_id, call_id=call_id, seq=seq, t=received))
        try:
            return await self._generate_and_answer(call, input_ids, sampling, rendered, render_s)
        finally:
            st.pending.discard(call_id)

    async def _render(self, st: RolloutState, conv: Conversation) -> tuple[RenderResult, float]:
        """Splicer.render, tokenizing in a worker thread when there is much new text; (result, seconds)."""
        async with st.render_lock:
            t0 = time.perf_counter()
            plan = st.splicer.plan(conv)
            if (self._render_limiter is None or not 0 < self.settings.render_thread_chars <= plan.chars
                    or not self.renderer.thread_safe):
                return st.splicer.tokenize(plan), time.perf_counter() - t0
            plan_s = time.perf_counter() - t0
            rendered, tokenize_s = await anyio.to_thread.run_sync(_timed_tokenize, st.splicer, plan,
                                                                  limiter=self._render_limiter)
            return rendered, plan_s + tokenize_s

    async def _generate_and_answer(
        self, call: _Call, input_ids: Any, sampling: EngineSampling, rendered: RenderResult, render_s: float
    ) -> Response | Stream:
        st, proto, sstate = call.st, call.proto, call.sstate
        engine = self.engine_for(st)
        rid = f"{st.request.rollout_id}|{call.call_id}"
        engine_start = time.time()
        # The engine call runs as a plain asyncio task (the server runs on asyncio): a task group + event + cancel
        # scope per call cost more than the rest of the waiting.
        task = asyncio.get_running_loop().create_task(
            run_engine(engine, input_ids, sampling, rid, self.settings.engine_retries, call.conv))
        resp, disconnected = await watch_engine(call.request, call.proto, call.sstate, call.stream, task, engine, rid,
                                                stream_head_s=self.settings.stream_head_s,
                                                keepalive_s=self.settings.keepalive_s)
        engine_end = time.time()
        # a stream whose head was not sent yet gets it in the same write as the rest (built first: Responses numbers
        # its events in order)
        head = proto.stream_open(sstate) if call.stream and resp is None and not disconnected else b""

        if disconnected:
            if not task.cancelled():
                task.exception()  # retrieved: whatever the engine said no longer matters
            self.log.bind(**call.ctx).info("client disconnected; engine request aborted")
            await self._fail(call, "client disconnected")
            return resp if resp is not None else Response(499)
        result, error = task.result()
        if error is not None:
            kind, msg = error
            self.log.bind(**call.ctx).warning("engine error", error=msg)
            return await self._answer_error(call, resp, head, kind, msg, reason=msg)
        assert result is not None
        if result.finish_reason == "abort":
            return await self._answer_error(call, resp, head, "server", "generation aborted",
                                            reason="engine aborted the request")

        out_ids = result.output_ids
        parsed = self.renderer.parse(out_ids)
        st.splicer.record(parsed, out_ids)
        finish = "length" if result.finish_reason == "length" else ("tool_calls" if parsed.tool_calls else "stop")
        n_in = int(input_ids.shape[0])
        reply = Reply(parsed=parsed, finish=finish, input_tokens=n_in, output_tokens=len(out_ids), model=call.model,
                      conv=call.conv)
        if call.stream:
            try:
                answer = finish_stream(call.request, resp, head, proto.stream_rest(sstate, reply), strict=True)
            except ConnectionError:
                # The harness never saw this answer, so it is no part of its trajectory: not a trainable call.
                self.log.bind(**call.ctx).info("client disconnected before the answer was delivered")
                await self._fail(call, "client disconnected before the answer was delivered")
                st.calls += 1
                return resp if resp is not None else Response(499)
        else:
            answer = Response(200, orjson.dumps(proto.response(reply)))
        await self.emit(ModelCall(
            rollout_id=st.request.rollout_id, call_id=call.call_id, seq=call.seq,
            protocol=proto.name,  # type: ignore[arg-type]
            label=call.label,  # type: ignore[arg-type]
            input_ids=pack_i32(input_ids), output_ids=pack_i32(out_ids), logprobs=pack_f32(result.logprobs),
            versions=result_versions(result, self.policy_version), finish_reason=finish,
            spliced_turns=len(rendered.spliced_turns), rendered_turns=len(rendered.rendered_turns), model=call.model,
            timings=CallTimings(received=call.received, engine_start=engine_start, engine_end=engine_end,
                                sent=time.time(), render_s=render_s),
            trace=call_trace(call.conv, parsed),
        ))
        st.calls += 1
        if self._stdlog.isEnabledFor(logging.DEBUG):
            self.log.bind(**call.ctx).debug("call done", input_tokens=n_in, output_tokens=len(out_ids),
                                            finish=finish, spliced=len(rendered.spliced_turns),
                                            rendered=len(rendered.rendered_turns))
        return answer

    async def _fail(self, call: _Call, reason: str) -> None:
        await self.emit(CallFailed(rollout_id=call.st.request.rollout_id, call_id=call.call_id, seq=call.seq,
                                   reason=reason, t=time.time()))

    async def _answer_error(self, call: _Call, resp: Stream | None, head: bytes, kind: ErrorKind,
                            message: str, *, reason: str) -> Response | Stream:
        """Record the call as failed (``reason``) and tell the client ``message``: an error event on a stream."""
        await self._fail(call, reason)
        if call.stream:
            return finish_stream(call.request, resp, head, call.proto.stream_error(call.sstate, kind, message))
        return error_response(call.proto, kind, message)


def _timed_tokenize(splicer: Splicer, plan: RenderPlan) -> tuple[RenderResult, float]:
    t0 = time.perf_counter()
    rendered = splicer.tokenize(plan)
    return rendered, time.perf_counter() - t0
