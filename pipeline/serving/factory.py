"""Opening the policy engine an experiment asks for: scripted (in-process), embedded (our torch server, its own
process) or SGLang (launched here, or attached to a running server / router). All three are used through the same
:class:`pipeline.serving.engine.Engine` interface; embedded and SGLang through the same HTTP client."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import msgspec

from pipeline.core.paths import REPO
from pipeline.serving.engine import Engine
from pipeline.tokens.render import Renderer, load_renderer


class EngineSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    kind: Literal["scripted", "embedded", "sglang"] = "embedded"
    model: str = ""  # HF model folder (embedded, sglang)
    script: str = ""  # script file (scripted)
    url: str = ""  # attach to a running SGLang server or router instead of launching one
    worker_urls: list[str] = msgspec.field(default_factory=list)  # with a router: workers get weight updates
    renderer: str = "qwen3"  # "qwen3" (built-in, offline) or a folder with a HF tokenizer + chat template
    enable_thinking: bool = False
    weight_version: int = 0
    max_running_requests: int = 32
    threads: int = 0  # embedded: torch threads (0 = half the cores)
    context_len: int = 0  # 0: the model's own
    sglang_args: list[str] = msgspec.field(default_factory=list)
    log_path: str = ""




def resolve_path(p: str) -> Path:
    """A relative path from a config: as given if it exists from the working directory, else from the repo root."""
    path = Path(p)
    if path.is_absolute() or path.exists():
        return path
    return REPO / path


def open_renderer(s: EngineSettings) -> Renderer:
    return load_renderer(s.renderer, enable_thinking=s.enable_thinking)


@contextlib.asynccontextmanager
async def open_engine(s: EngineSettings, renderer: Renderer, *, run_dir: Path | None = None) -> AsyncIterator[Engine]:
    log_path = Path(s.log_path) if s.log_path else (run_dir / f"engine-{s.kind}.log" if run_dir else None)
    if s.kind == "scripted":
        from pipeline.serving.scripted import ScriptedEngine, load_script

        if not s.script:
            raise ValueError("[engine].script: the scripted engine needs a script file")
        yield ScriptedEngine(renderer, load_script(resolve_path(s.script)), weight_version=s.weight_version)
        return
    if s.kind == "embedded":
        from pipeline.serving.launch import start_embedded_engine

        if not s.model:
            raise ValueError("[engine].model: the embedded engine needs a HF model folder")
        async with start_embedded_engine(
            s.model, weight_version=str(s.weight_version), max_running_requests=s.max_running_requests,
            threads=s.threads, context_length=s.context_len or None, log_path=log_path,
        ) as client:
            yield client
        return
    from pipeline.serving.launch import attach, launch_sglang

    if s.url:
        async with attach(s.url, worker_urls=s.worker_urls or None) as client:
            yield client
        return
    if not s.model:
        raise ValueError("[engine].model: SGLang needs a model path (or [engine].url to attach)")
    async with launch_sglang(s.model, weight_version=str(s.weight_version), extra_args=s.sglang_args,
                             log_path=log_path) as client:
        yield client
