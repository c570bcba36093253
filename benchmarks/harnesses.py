#!/usr/bin/env python3
"""Per-harness rollouts: calls, tokens per call, wall time, the rewrites the tree builder meets, and how each
harness's subagent and compaction calls are labelled.

    python benchmarks/harnesses.py [--backend local|docker] [--harnesses claude-code,codex,...] [--repeats 3]
                                   [--no-aux] [--out FILE.md]

Each harness runs a generated ``create_word`` task in a sandbox of the chosen backend (Docker: the harness's image,
network ``none``; a harness without an image in its adapter is skipped) against the real proxy over the scripted
engine: three shell tool calls (write the file, cat it, wc it) and a final answer, ``--repeats`` times. The table
shows calls per rollout, input and output tokens per call (median / max over every call), the rollout's wall time
(queued to verified, median; and the harness alone), the reward, and how the tree builder attached the calls
(``exact``, ``rewrite:<name>``, ...). Then, unless ``--no-aux``, one rollout per side-call scenario the harness has
(a subagent, a forced compaction) shows what the proxy labelled and whether the tree confirmed it: the subagent's
calls in a chain of their own, the compaction's summary starting the next segment, every main call trained.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import anyio
import msgspec

from pipeline.messages import ModelCall, RolloutFinished, RolloutRequest, SettledRollout
from pipeline.rollout.harnesses import HARNESSES, Harness, Launch, LaunchContext
from pipeline.rollout.sandbox import DockerBackend, DockerSettings, LocalBackend, LocalSettings
from pipeline.rollout.taskgen import generate
from pipeline.rollout.tasks import Task, materialize
from pipeline.serving.proxy import Proxy, ProxySettings
from pipeline.serving.scripted import Script, ScriptCall, ScriptedEngine, ScriptResponse, ScriptRoute
from pipeline.tokens.render import qwen3_renderer
from pipeline.trees.tree import RolloutTree, build_tree

# Each harness's shell tool: (name, the argument that holds the command, extra arguments).
SHELL = {
    "claude-code": ("Bash", "command", {"description": "Run it"}),
    "codex": ("exec_command", "cmd", {}),
    "qwen-code": ("run_shell_command", "command", {"description": "Run it"}),
    "openclaw": ("exec", "command", {}),
    "whitebox": ("bash", "command", {}),
}


def shell(harness: str, command: str) -> ScriptResponse:
    name, arg, extra = SHELL[harness.split(":")[0]]
    return ScriptResponse(tool_calls=[ScriptCall(name=name, arguments={arg: command, **extra})])


def say(text: str) -> ScriptResponse:
    return ScriptResponse(text=text)


@dataclass
class Scenario:
    """One scripted rollout of a harness: its responses, routes, and a launch edit (env, config) if any."""

    kind: str  # tools, subagent, compaction
    responses: list[ScriptResponse]
    routes: list[ScriptRoute] = field(default_factory=list)
    edit: Callable[[LaunchContext, Launch], None] | None = None


def tools_scenario(harness: str, path: str, word: str) -> Scenario:
    return Scenario("tools", [shell(harness, f"printf '%s' {word} > {path}"), shell(harness, f"cat {path}"),
                              shell(harness, f"wc -c {path}"), say(f"{path} holds {word}.")])


def listing(word: str, n: int) -> str:
    return f"seq -f '{word} %g: the quick brown fox jumps over the lazy dog' 1 {n}"


SUMMARY = ("<analysis>\nTwo listings were asked for, then the file.\n</analysis>\n<summary>\n"
           "1. Primary request: print two listings, then write the file.\n2. Done so far: both listings were "
           "printed.\n3. Pending: write the file and check it.\n</summary>")


def _env(**env: str) -> Callable[[LaunchContext, Launch], None]:
    def edit(_ctx: LaunchContext, launch: Launch) -> None:
        launch.env.update(env)
    return edit


def _codex_limit(limit: int) -> Callable[[LaunchContext, Launch], None]:
    def edit(_ctx: LaunchContext, launch: Launch) -> None:
        path = next(p for p in launch.files if p.endswith("config.toml"))
        launch.files[path] = f"model_auto_compact_token_limit = {limit}\n" + launch.files[path]
    return edit


def aux_scenarios(harness: str, path: str, word: str) -> list[Scenario]:
    """The subagent and compaction recipes measured for each harness (tests/trees/test_tree_aux_recordings.py
    explains the numbers)."""
    task = f"Write the word {word} into {path}."
    write, check = shell(harness, f"printf '%s' {word} > {path}"), shell(harness, f"cat {path}")
    wait = shell(harness, f"while [ ! -s {path} ]; do sleep 0.2; done; sleep 5; cat {path}")
    sub = [ScriptRoute(opening=task, responses=[write, say("Done.")])]
    if harness == "claude-code":
        agent = ScriptResponse(tool_calls=[ScriptCall(name="Agent", arguments={
            "description": "Write the file", "prompt": task, "subagent_type": "general-purpose"})])
        return [
            Scenario("subagent", [agent, check, say("Done.")], sub),
            Scenario("compaction", [shell(harness, listing("line", 150)), shell(harness, listing("row", 150)),
                                    say(SUMMARY), write, check, say("Done.")],
                     edit=_env(CLAUDE_CODE_AUTO_COMPACT_WINDOW="100000", CLAUDE_AUTOCOMPACT_PCT_OVERRIDE="27.25")),
        ]
    if harness == "codex":
        spawn = ScriptResponse(tool_calls=[ScriptCall(name="multi_agent_v1__spawn_agent",
                                                      arguments={"message": task})])
        return [
            Scenario("subagent", [spawn, wait, say("Done.")], sub),
            Scenario("compaction", [shell(harness, "echo start"), shell(harness, listing("line", 150)),
                                    say("Summary: a listing was printed. Remaining: write the file."), write, check,
                                    say("Done.")], edit=_codex_limit(10000)),
        ]
    if harness == "whitebox":
        def c1(ctx: LaunchContext, launch: Launch) -> None:
            launch.argv[launch.argv.index("--config") + 1] = "S0T0O0C1W0"
            launch.argv += ["--summary-budget-chars", "1500"]
        return [Scenario("compaction", [shell(harness, listing("line", 40)), shell(harness, "echo next"),
                                        say("Summary: a listing was printed. Remaining: write the file."), write,
                                        check, say("Done.")], edit=c1)]
    return []


@dataclass
class Result:
    harness: str
    kind: str
    finished: RolloutFinished
    calls: list[ModelCall]
    tree: RolloutTree

    @property
    def wall_s(self) -> float:
        t = self.finished.timings
        return t.verified - t.queued if t.verified else float("nan")

    @property
    def harness_s(self) -> float:
        t = self.finished.timings
        return t.harness_done - t.sandbox_ready if t.harness_done else float("nan")


@contextlib.asynccontextmanager
async def scripted_proxy(script: Script, sock: Path) -> AsyncIterator[tuple[Proxy, list]]:
    renderer = qwen3_renderer()
    records: list = []

    async def keep(record: object) -> None:
        records.append(record)

    proxy = Proxy(ScriptedEngine(renderer, script), renderer, keep, ProxySettings(unix_socket=str(sock)))
    await proxy.start()
    try:
        yield proxy, records
    finally:
        await proxy.stop()


def _wrapped(h: Harness, edit: Callable[[LaunchContext, Launch], None], name: str) -> Harness:
    def launcher(ctx: LaunchContext, variant: str) -> Launch:
        launch = h.launcher(ctx, variant)
        edit(ctx, launch)
        return launch
    return replace(h, name=name, launcher=launcher)


async def run_one(backend, harness: str, sc: Scenario, task: Task, tmp: Path, n: int) -> Result:
    rid = f"{harness}-{sc.kind}-{n}"
    name = harness
    if sc.edit is not None:  # a variant of the harness's adapter for this rollout only
        name = f"{harness}-{sc.kind}"
        HARNESSES[name] = _wrapped(HARNESSES[harness], sc.edit, name)
    sock = tmp / f"{rid}.sock"
    try:
        async with scripted_proxy(Script(rollouts={rid: sc.responses}, routes=sc.routes), sock) as (proxy, records):
            req = RolloutRequest(rollout_id=rid, group_id=rid, index=0, group_size=1, task_id=task.id, harness=name,
                                 token=f"bench-{rid}", policy_version=0, timeout_s=300)
            proxy.register(req)
            finished = await backend.run(req, task, proxy_url=proxy.base_url, proxy_socket=str(sock))
            await anyio.sleep(1.0)  # calls of a subagent still winding down are recorded too
    finally:
        if name != harness:
            del HARNESSES[name]
    calls = [r for r in records if isinstance(r, ModelCall)]
    tree = build_tree(SettledRollout(request=req, finished=finished, calls=calls))
    return Result(harness, sc.kind, finished, calls, tree)


def _med_max(values: list[int]) -> str:
    return f"{statistics.median(values):,.0f} / {max(values):,}" if values else "-"


def tools_row(harness: str, results: list[Result]) -> list[str]:
    calls = [c for r in results for c in r.calls]
    attach: Counter[str] = Counter()
    for r in results:
        attach.update(r.tree.stats.attach)
    rewrites = " ".join(f"{k}={v}" for k, v in sorted(attach.items()))
    status = " ".join(f"{k}×{v}" for k, v in Counter(r.finished.status for r in results).items())
    wall = statistics.median(r.wall_s for r in results)
    alone = statistics.median(r.harness_s for r in results)
    reward = statistics.mean(r.finished.reward for r in results)
    return [harness, f"{statistics.median(len(r.calls) for r in results):.0f}",
            _med_max([len(c.input_ids) // 4 for c in calls]), _med_max([len(c.output_ids) // 4 for c in calls]),
            f"{wall:.1f} ({alone:.1f})", f"{status}, reward {reward:.2f}", rewrites]


def aux_cell(r: Result) -> str:
    """What the proxy labelled and whether the tree confirmed it."""
    s, labels = r.tree.stats, Counter(c.label for c in r.calls)
    if r.finished.status != "ok":
        return f"{r.kind}: rollout {r.finished.status}"
    main_trained = s.calls_by_fate.get("trained", 0) == labels.get("main", 0)
    if r.kind == "subagent":
        chains = {c.chain for c in r.tree.calls if c.label == "subagent"}
        ok = labels.get("subagent", 0) > 0 and len(chains) == 1 and not r.tree.relabelled and main_trained
        return f"subagent: {labels.get('subagent', 0)} calls labelled, own chain {'yes' if ok else 'NO'}"
    comp = [c for c in r.tree.calls if c.label == "compaction"]
    confirmed = sum(c.summary_for >= 0 for c in comp)
    ok = comp and confirmed == len(comp) and s.unjoined_segments == 0 and main_trained and not r.tree.relabelled
    return (f"compaction: {labels.get('compaction', 0)} labelled, {confirmed} confirmed, {s.segments} segments, "
            f"main calls trained {'yes' if ok else 'NO'}")


def table(header: tuple[str, ...], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
                     + ["| " + " | ".join(r) + " |" for r in rows])


async def image_exists(image: str) -> bool:
    if shutil.which("docker") is None:
        return False
    return (await anyio.run_process(["docker", "image", "inspect", image], check=False)).returncode == 0


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("local", "docker"), default="local")
    p.add_argument("--harnesses", default="claude-code,codex,qwen-code,openclaw,whitebox")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-aux", action="store_true", help="skip the subagent and compaction rollouts")
    p.add_argument("--out", default="", help="also write the tables (markdown) to this file")
    args = p.parse_args()
    spec = generate("create_word", 7)
    path, word = msgspec.json.decode(spec.solution["actions.json"])[0]["args"].values()
    backend = LocalBackend(LocalSettings()) if args.backend == "local" else DockerBackend(DockerSettings())
    await backend.start()
    tool_rows, aux_rows, skipped = [], [], []
    try:
        with tempfile.TemporaryDirectory(prefix="bridle-harness-bench-") as d:
            tmp = Path(d)
            task = materialize(spec, tmp / "task")
            for harness in args.harnesses.split(","):
                h = HARNESSES[harness]
                if args.backend == "docker" and not (h.image and await image_exists(h.image)):
                    skipped.append(f"{harness}: no Docker image in its adapter" if not h.image
                                   else f"{harness}: image {h.image} not built")
                    continue
                t0 = time.time()
                results = [await run_one(backend, harness, tools_scenario(harness, path, word), task, tmp, n)
                           for n in range(args.repeats)]
                tool_rows.append(tools_row(harness, results))
                cells = [] if args.no_aux else [aux_cell(await run_one(backend, harness, sc, task, tmp, 0))
                                                 for sc in aux_scenarios(harness, path, word)]
                aux_rows.append([harness, "; ".join(cells) or "no recipe here (see docs/harnesses.md)"])
                print(f"{harness}: done in {time.time() - t0:.0f} s", file=sys.stderr)
    finally:
        await backend.aclose()
    when = datetime.date.today().isoformat()
    out = [(f"{when}, backend {args.backend}, {os.cpu_count()} cores, {args.repeats} rollouts per harness "
            "(3 tool calls + a final answer each)"), "",
           table(("harness", "calls / rollout", "input tokens / call (median / max)",
                  "output tokens / call (median / max)", "wall s: rollout (harness)", "status, reward",
                  "how calls attached"), tool_rows)]
    if aux_rows and not args.no_aux:
        out += ["", table(("harness", "subagent / compaction labelling"), aux_rows)]
    if skipped:
        out += ["", "skipped: " + "; ".join(skipped)]
    text = "\n".join(out)
    print(text)
    if args.out:
        await anyio.Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    anyio.run(main)
