"""Opening the policy engine an experiment asks for (``[proxy.engine]``): scripted (in-process), embedded (our
torch server, its own process; ``replicas = N`` of them behind sglang-router), SGLang (launched here; running
servers behind a router launched here; or attached to a running server / router), or a teacher behind an
OpenAI-compatible endpoint (``openai``: recording only). All are used through the same
:class:`pipeline.serving.engine.Engine` interface; embedded and SGLang through the same HTTP client,
:class:`pipeline.serving.sglang_client.HttpEngine`."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from pipeline.core.paths import REPO
from pipeline.serving.engine import Engine
from pipeline.serving.launch import DEFAULT_PREFIX_CACHE_MB, attach, launch_embedded, launch_sglang
from pipeline.serving.router import RouterSettings, launch_embedded_fleet, launch_router_over
from pipeline.serving.scripted import ScriptedEngine, load_script
from pipeline.serving.sglang_client import HttpEngine
from pipeline.serving.teacher import TeacherEngine, api_key_from
from pipeline.tokens.render import BUILTIN_QWEN, Renderer, load_renderer


class EngineSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[proxy.engine]``: which engine serves ``[run].model``, and how to start it. ``kind`` selects which of the
    other fields apply (KIND_FIELDS); a field set for another kind is refused, naming the kind that reads it."""

    # openai: a teacher model behind any OpenAI-compatible endpoint answers (recording only; pipeline/serving/teacher.py)
    kind: Literal["scripted", "embedded", "sglang", "openai"] = "embedded"
    renderer: str = "qwen3"  # "qwen3" (built-in, offline) or a folder with a HF tokenizer + chat template
    # how the model writes tool calls: "auto" (from the renderer folder's chat template / config.json) or a name in
    # pipeline/tokens/toolparse.py FORMATS ("hermes", "llama3_json", "mistral")
    tool_format: str = "auto"
    enable_thinking: bool = False  # render prompts with the template's thinking turned on
    weight_version: int = 0  # the policy version the engine starts with (sent as a string)
    script: str = ""  # scripted: the script file
    # sglang: attach to a running server or router instead of launching one; openai: the base URL (…/v1)
    url: str = ""
    # sglang: the servers behind `url` (they get the weight updates); without `url`, bridle starts sglang-router
    # in front of them ([proxy.engine.router])
    server_urls: list[str] = msgspec.field(default_factory=list)
    sglang_args: list[str] = msgspec.field(default_factory=list)  # sglang: extra launch_server arguments
    # embedded: this many engine processes (each its own port and copy of the weights, `threads` each) behind
    # sglang-router ([proxy.engine.router]); weight updates go to every one
    replicas: Annotated[int, msgspec.Meta(ge=1)] = 1
    router: RouterSettings = msgspec.field(default_factory=RouterSettings)  # embedded replicas, sglang server_urls
    max_running_requests: Annotated[int, msgspec.Meta(ge=1)] = 32  # embedded
    threads: Annotated[int, msgspec.Meta(ge=0)] = 0  # embedded: torch threads per engine (0 = half the cores, shared out among the replicas)
    context_len: Annotated[int, msgspec.Meta(ge=0)] = 0  # embedded: the context length (0: the model's own)
    device: str = "cpu"  # embedded: "cpu", "cuda" or "cuda:N" (where its model runs)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # embedded: the served weights' dtype
    # embedded: MiB of KV its prefix cache may hold (0 = off); a prompt's longest cached prefix is not computed again
    prefix_cache_mb: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = DEFAULT_PREFIX_CACHE_MB
    log_path: str = ""  # embedded, sglang: the engine process's log (default: engine-<kind>.log in the run folder)
    served_model: str = ""  # openai: the model name the endpoint serves
    api_key_env: str = ""  # openai: the environment variable holding the endpoint's key (never the key itself)
    request_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0  # openai: seconds one answer may take


# The fields of [proxy.engine] every kind reads, and those only some kinds read.
COMMON_FIELDS = frozenset({"kind", "renderer", "tool_format", "enable_thinking", "weight_version"})
KIND_FIELDS: dict[str, frozenset[str]] = {
    "scripted": frozenset({"script"}),
    "embedded": frozenset({"replicas", "router", "max_running_requests", "threads", "context_len", "device", "dtype",
                           "prefix_cache_mb", "log_path"}),
    "sglang": frozenset({"url", "server_urls", "router", "sglang_args", "log_path"}),
    "openai": frozenset({"url", "served_model", "api_key_env", "request_timeout_s"}),
}


def engine_problem(s: EngineSettings) -> str:
    """A field set that ``s.kind`` does not read (it would do nothing), or several engines asked of a kind that
    cannot have them; "" when nothing is wrong."""
    if s.kind == "sglang" and s.replicas > 1:
        return (f"[engine].replicas = {s.replicas} starts several embedded engines; with kind = 'sglang' list "
                "running SGLang servers in [engine].server_urls instead (bridle starts the router in front of them)")
    defaults = EngineSettings()
    for f in msgspec.structs.fields(EngineSettings):
        if f.name in COMMON_FIELDS or f.name in KIND_FIELDS[s.kind] or getattr(s, f.name) == getattr(defaults, f.name):
            continue
        owners = " or ".join(f'"{k}"' for k, names in KIND_FIELDS.items() if f.name in names)
        return (f'[engine].{f.name} is read by kind = {owners} only, and [engine].kind = "{s.kind}". Remove it, or '
                f"replace the whole table to change the kind: --set 'proxy.engine={{kind=\"{s.kind}\", ...}}'")
    return ""


def renderer_problem(s: EngineSettings, model: str) -> str:
    """What is wrong with rendering ``model``'s prompts with ``s.renderer`` ("" when nothing, or when the model
    folder is not there yet: a built model appears at its first use). The built-in renderer is Qwen's template and
    vocabulary; another family's model would be sent ids of a vocabulary it does not have."""
    if s.renderer.lower() not in BUILTIN_QWEN or not model:
        return ""
    try:
        model_type = str(json.loads((resolve_path(model) / "config.json").read_text()).get("model_type", ""))
    except (OSError, ValueError):
        return ""
    if not model_type or model_type.lower().startswith("qwen"):
        return ""
    return (f'[engine].renderer = "{s.renderer}" is the built-in Qwen3 chat template and tokenizer, but the model '
            f'({model}) is a "{model_type}" model: its prompts would be token ids of another vocabulary. Set '
            f'[engine].renderer = "{model}" (its own chat template and tokenizer)')


def engine_threads(replicas: int) -> int:
    """Torch threads per embedded engine when ``threads = 0``: half the cores in all (oversubscribed OpenMP threads
    are much slower; the other half serve the harnesses and the learner), shared out among the replicas."""
    return max(1, (os.cpu_count() or 2) // 2 // replicas)


def resolve_path(p: str) -> Path:
    """A relative path from a config: as given if it exists from the working directory, else from the repo root."""
    path = Path(p)
    if path.is_absolute() or path.exists():
        return path
    return REPO / path


def open_renderer(s: EngineSettings) -> Renderer:
    """The chat template and tokenizer that turn harness requests into the engine's token ids."""
    return load_renderer(s.renderer, enable_thinking=s.enable_thinking, tool_format=s.tool_format)


@contextlib.asynccontextmanager
async def open_engine(
    s: EngineSettings, renderer: Renderer, *, model: str = "", run_dir: Path | None = None
) -> AsyncIterator[Engine]:
    """The engine ``s`` describes, serving ``model`` (a HF folder: ``[run].model``), ready; a launched engine process
    stops when the context exits."""
    if problem := engine_problem(s):
        raise ValueError(problem)
    if s.kind == "scripted":
        if not s.script:
            raise ValueError("[engine].script: the scripted engine needs a script file")
        yield ScriptedEngine(renderer, load_script(resolve_path(s.script)), weight_version=s.weight_version)
        return
    if s.kind == "openai":
        if not s.url or not s.served_model:
            raise ValueError('[engine]: kind = "openai" needs url (the endpoint\'s base URL, e.g. '
                             'http://host:8000/v1) and served_model (the model name it serves)')
        teacher = TeacherEngine(renderer, s.url, s.served_model, api_key=api_key_from(s.api_key_env),
                                timeout_s=s.request_timeout_s, weight_version=s.weight_version)
        try:
            yield teacher
        finally:
            await teacher.aclose()
        return
    log_path = Path(s.log_path) if s.log_path else (run_dir / f"engine-{s.kind}.log" if run_dir else None)
    async with _http_engine(s, model, log_path) as client:
        yield client


def _http_engine(s: EngineSettings, model: str, log_path: Path | None) -> AbstractAsyncContextManager[HttpEngine]:
    if s.kind == "embedded":
        if not model:
            raise ValueError("[run].model: the embedded engine needs a HF model folder")
        options = {"weight_version": str(s.weight_version), "max_running_requests": s.max_running_requests,
                   "threads": s.threads or engine_threads(s.replicas), "context_length": s.context_len or None,
                   "device": s.device, "dtype": s.dtype, "prefix_cache_mb": s.prefix_cache_mb}
        if s.replicas > 1:
            return launch_embedded_fleet(model, s.replicas, s.router, log_path=log_path, **options)
        return launch_embedded(model, log_path=log_path, **options)
    if s.url:
        return attach(s.url, worker_urls=s.server_urls or None)
    if s.server_urls:
        return launch_router_over(s.server_urls, s.router, log_path=log_path)
    if not model:
        raise ValueError("[run].model: SGLang needs a model path (or [engine].url to attach)")
    return launch_sglang(
        model, weight_version=str(s.weight_version), extra_args=s.sglang_args, log_path=log_path
    )
