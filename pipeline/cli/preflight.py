"""What a run will need from this machine, checked before it starts (and by ``run.py --validate``).

Loading an experiment checks the file itself; these checks look at the machine: the policy's folder, the renderer's
chat template, an engine that is installed, the Docker engine and the harness images, the images task Dockerfiles
build on, harness executables for the local backend. Every problem is one line naming the setting and what to do,
and all are reported at once, so a run is never started only to fail each rollout the same way.

Replaying a log does not come here: a recorded run replays on a machine that lacks its model or images.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import anyio

from pipeline.core import config as cfg
from pipeline.core.config import model_folder_problem
from pipeline.rollout.harnesses import find_binary, harness_for
from pipeline.tokens.render import BUILTIN_QWEN

SGLANG_INSTALL = ("on a GPU machine install bridle with it (pip install -e '.[sglang]', the README's GPU install), "
                  "or attach a running server with [proxy.engine].url")


def problems(exp: cfg.Experiment) -> list[str]:
    """Every problem this machine has with running ``exp`` (empty: none found)."""
    out: list[str] = []
    engines = [(n, s.engine) for n, s in exp.sections.items() if exp.graph.actors[n] == "proxy"]
    needs_model = "learner" in exp.graph.actors.values() or any(
        e.kind != "scripted" and not e.url for _n, e in engines)
    if exp.run.model and needs_model and (
            why := model_folder_problem(exp.run.model, build=bool(exp.experiment.build_model))):
        out.append(why)
    for name, e in engines:
        if e.kind == "sglang" and not e.url and importlib.util.find_spec("sglang") is None:
            out.append(f'[{name}.engine].kind = "sglang": SGLang is not installed in this Python; {SGLANG_INSTALL}')
        if e.kind != "scripted" and (why := renderer_folder_problem(e.renderer, f"[{name}.engine].renderer")):
            out.append(why)
    for name, sec in exp.sections.items():
        if exp.graph.actors[name] == "sandbox":
            out += _sandbox_problems(exp, name, sec)
    return out


def renderer_folder_problem(renderer: str, field: str) -> str:
    """A renderer folder must exist and hold a tokenizer and a chat template ("" for the built-in renderer)."""
    if renderer.lower() in BUILTIN_QWEN:
        return ""
    folder = Path(renderer)
    if not folder.is_dir():
        return f"{field} = {renderer!r}: no such folder; give a folder with the model's tokenizer and chat template"
    vocab = (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file() or (
        (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file())
    if not vocab:
        return (f"{field} = {renderer!r}: no tokenizer there (tokenizer.json, tokenizer.model, or vocab.json with "
                "merges.txt); name the model's own folder, or copy its tokenizer files into this one")
    config = folder / "tokenizer_config.json"
    template = config.is_file() and bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template"))
    if not template and not (folder / "chat_template.jinja").is_file():
        return (f"{field} = {renderer!r}: no chat template there (tokenizer_config.json's chat_template or "
                "chat_template.jinja); copy the model's template into that folder, or name a folder that has one")
    return ""


def _harnesses(exp: cfg.Experiment) -> set[str]:
    """The harness names (variants dropped) that the run's scheduler and evaluator will start."""
    names: set[str] = set()
    for name, sec in exp.sections.items():
        kind = exp.graph.actors[name]
        if kind == "scheduler":
            names |= {sec.harness, *sec.harnesses} if sec.mode != "scaling" else {"whitebox"}
        elif kind == "evaluator":
            names |= set(sec.harnesses) | ({"whitebox"} if sec.columns else set())
    return {harness_for(h)[0].name for h in names if h}


def _task_sources(exp: cfg.Experiment) -> list[Path]:
    """Task folders (not built-in families) the run's scheduler and evaluator read."""
    out = []
    for name, sec in exp.sections.items():
        if exp.graph.actors[name] in ("scheduler", "evaluator"):
            for src in (getattr(sec, "tasks", None), getattr(sec, "sft_tasks", None)):
                if src is not None and not src.tasks.startswith("builtin:"):
                    out.append(Path(src.tasks))
    return out


def _sandbox_problems(exp: cfg.Experiment, name: str, sec: Any) -> list[str]:
    harnesses = [harness_for(h)[0] for h in sorted(_harnesses(exp))]
    if sec.backend == "local":
        where = sec.local.harness_bin
        out = []
        for h in harnesses:
            if not h.executable:
                continue
            found = (Path(where) / h.executable).exists() if where else bool(find_binary(h.executable))
            if not found:
                out.append(f"[{name}] backend = \"local\": the {h.name} executable ({h.executable}) is not in "
                           f"{where or '$BRIDLE_HARNESS_BIN or PATH'}; npm install {' '.join(h.npm_packages)} and set "
                           "BRIDLE_HARNESS_BIN to its node_modules/.bin")
        return out
    if sec.backend != "docker":
        return []  # Ray: each node's images and limits are checked by its sandboxes when they start
    limits = [why] if (why := sec.docker.machine_problem(f"[{name}.docker]")) else []
    images = sorted({h.image for h in harnesses if h.image})
    bases = _dockerfile_bases(_task_sources(exp))
    return limits + anyio.run(_docker_problems, name, sec.docker, images, bases)


def _dockerfile_bases(folders: list[Path]) -> dict[str, list[str]]:
    """image a task Dockerfile builds on -> the tasks that name it."""
    from pipeline.rollout.sandbox.dockerfile import DockerfileError, base_images
    from pipeline.rollout.tasks import load_task_dir

    out: dict[str, list[str]] = {}
    for folder in folders:
        if not folder.is_dir():
            continue  # the config check names a missing folder
        for task in load_task_dir(folder):
            if task.dockerfile is None or task.config.environment.docker_image:
                continue
            try:
                refs = base_images(task.dockerfile.read_text(encoding="utf-8"))
            except DockerfileError:
                continue  # the task check reports it
            for r in refs:
                out.setdefault(r.image, []).append(task.id)
    return out


async def _docker_problems(name: str, settings: Any, images: list[str], bases: dict[str, list[str]]) -> list[str]:
    import aiodocker

    docker = aiodocker.Docker(url=settings.docker_url or None)
    out: list[str] = []
    try:
        try:
            with anyio.fail_after(min(settings.api_timeout_s, 15)):
                await docker.version()
        except Exception as e:  # noqa: BLE001 - any failure to reach it is the same advice
            return [(f"[{name}] backend = \"docker\": cannot reach the Docker engine ({type(e).__name__}: {e}); start "
                     "dockerd (harness_images/ci_setup.sh shows how) or use backend = \"local\"")]

        async def present(ref: str) -> bool:
            try:
                with anyio.fail_after(settings.api_timeout_s):
                    await docker.images.inspect(ref)
                return True
            except aiodocker.DockerError:
                return False

        missing = [i for i in images if not await present(i)]
        if missing:
            out.append(f"[{name}] backend = \"docker\": the harness image(s) {', '.join(missing)} are not built; "
                       "run `python run.py --build-images` (offline)")
        for ref, tasks in sorted(bases.items()):
            sub = settings.base_images.get(ref, "")
            if await present(ref) or (sub and await present(sub)):
                continue
            also = f", nor its [{name}.docker] base_images substitute {sub}" if sub else ""
            out.append(f"the image {ref}, which the Dockerfile of {len(tasks)} task(s) builds on ({', '.join(tasks[:3])}"
                       f"{' ...' if len(tasks) > 3 else ''}), is not on this machine{also}; bridle never pulls: "
                       f"`docker load -i FILE`, `docker tag LOCAL_IMAGE {ref}`, or map it in [{name}.docker] "
                       f'base_images = {{ "{ref}" = "LOCAL_IMAGE" }} (bridle-rootfs:bookworm is one)')
    finally:
        await docker.close()
    return out
