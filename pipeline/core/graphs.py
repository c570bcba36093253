"""Graph presets: the shipped actor graphs by name, so an experiment file holds only what makes it itself.

``[graph]`` of an experiment file either names a preset (``preset = "serve"``; with no ``[graph]`` at all, or one
that names no actors, the preset is ``train``) or spells out a custom graph (``actors`` and ``edges``). Beside a
preset, ``[graph]`` may still set ``queue_size``, ``inbox_sizes`` and ``stop_after``.

- ``train``: scheduler -> proxy -> sandboxes -> collector -> tree builder -> learner, weights back to the proxy and
  the scheduler, metrics to the monitor. With an ``[eval]`` section the evaluator joins (its rounds go through the
  same proxy, sandboxes and collector), and the run also waits for its last round when ``[eval].every_steps > 0``.
- ``eval``: ``train`` without scheduler, tree builder and learner: one evaluation round of the served policy
  (``run.py --eval`` derives the same graph from a ``train`` file).
- ``serve``: the proxy alone (``run.py --serve``: record any harness by hand).
- ``toy``: three demonstration actors on bounded queues (``actors/toy.py``).
"""

from __future__ import annotations

from typing import Any

PRESETS = ("train", "eval", "serve", "toy")

# The actor names of the train preset are its sections' names: [scheduler], [proxy], ..., [eval].
TRAIN_ACTORS = {
    "scheduler": "scheduler", "proxy": "proxy", "sandbox": "sandbox", "collector": "collector", "tree": "tree",
    "learner": "learner", "monitor": "monitor",
}
TRAIN_EDGES = [
    "scheduler.requests -> proxy",
    "proxy.rollouts -> sandbox",
    "proxy.rollouts -> collector",
    "proxy.calls -> collector",
    "sandbox.finished -> collector",
    "sandbox.finished -> scheduler",
    "sandbox.finished -> monitor",  # statuses and first reasons on the display; a run where none succeeded says so
    "collector.settled -> tree",
    "scheduler.recorded -> tree",   # [scheduler].sft_recordings: demonstrations from earlier runs' event logs
    "collector.settled -> proxy",   # the proxy forgets a settled rollout's token
    "tree.groups -> learner",
    "tree.dropped -> learner",
    "learner.updates -> proxy",
    "proxy.engines -> learner",
    "learner.updates -> scheduler",
    "learner.resample -> scheduler",  # [run].dynamic_sampling
    "scheduler.metrics -> monitor",
    "sandbox.metrics -> monitor",
    "tree.metrics -> monitor",
    "learner.metrics -> monitor",
    "proxy.metrics -> monitor",
]
EVAL_ACTOR = "eval"
EVAL_EDGES = [
    "eval.requests -> proxy",
    "collector.settled -> eval",
    "learner.updates -> eval",
    "eval.metrics -> monitor",
]
# What an evaluation keeps of a training graph (run.py --eval, and the eval preset).
EVAL_KINDS = frozenset({"proxy", "sandbox", "collector", "monitor", "evaluator"})


class PresetError(ValueError):
    """Raised as the config layer's ConfigError by the caller (no import cycle)."""


def expand(raw: dict[str, Any], source: str) -> str | None:
    """Replace ``raw["graph"]`` (the file's tables, overrides applied) by the graph it stands for, in place.

    Returns the preset's name, or None for a custom graph (``[graph].actors`` given), which is left as it is."""
    graph = raw.get("graph", {})
    if not isinstance(graph, dict):
        return None  # the section decoder says what is wrong with it
    preset = graph.pop("preset", None)
    if graph.get("actors"):
        if preset is not None:
            raise PresetError(f"{source}: [graph] sets both preset = {preset!r} and actors: a preset names its own "
                              "actors; remove one of the two (actors and edges are for a custom graph)")
        return None
    if "edges" in graph:
        raise PresetError(f"{source}: [graph].edges without [graph].actors: a custom graph needs both; to use a "
                          "preset, remove edges")
    preset = "train" if preset is None else preset
    if preset not in PRESETS:
        raise PresetError(f"{source}: [graph].preset = {preset!r}: expected one of {', '.join(PRESETS)} "
                          "(pipeline/core/graphs.py), or a custom graph in [graph].actors and [graph].edges")
    defaults = _preset(preset, raw)
    raw["graph"] = {**defaults, **graph}
    return preset


def _preset(name: str, raw: dict[str, Any]) -> dict[str, Any]:
    if name == "serve":
        return {"actors": {"proxy": "proxy"}, "edges": []}
    if name == "toy":
        return {"actors": {"source": "actors.toy:Source", "scale": "actors.toy:Scale", "sink": "actors.toy:Sink"},
                "edges": ["source.out -> scale", "scale.out -> sink"], "queue_size": 8}
    with_eval = name == "eval" or EVAL_ACTOR in raw
    actors = dict(TRAIN_ACTORS) | ({EVAL_ACTOR: "evaluator"} if with_eval else {})
    edges = TRAIN_EDGES + (EVAL_EDGES if with_eval else [])
    if name == "eval":
        actors = {n: k for n, k in actors.items() if k in EVAL_KINDS}
        edges = keep_edges(edges, set(actors))
        ev = raw.setdefault(EVAL_ACTOR, {})
        if isinstance(ev, dict):
            ev.setdefault("standalone", True)  # one round of the served policy, then the run ends
        return {"actors": actors, "edges": edges, "stop_after": [EVAL_ACTOR]}
    every = raw.get(EVAL_ACTOR, {}).get("every_steps", 0) if isinstance(raw.get(EVAL_ACTOR), dict) else 0
    # rounds during training: the run ends after the last one, not when the learner returns
    stop_after = ["learner", EVAL_ACTOR] if with_eval and isinstance(every, int) and every > 0 else ["learner"]
    return {"actors": actors, "edges": edges, "stop_after": stop_after}


def keep_edges(edges: list[str], keep: set[str]) -> list[str]:
    """The edges both of whose ends are in ``keep``."""
    return [e for e in edges if all(p.strip().split(".")[0] in keep for p in e.split("->"))]


def describe(actors: dict[str, str], edges: list[tuple[str, str, str]], stop_after: list[str]) -> list[str]:
    """The graph as lines for ``--validate``: each actor, its kind, and where each of its outputs goes."""
    width = max(map(len, actors), default=0)
    lines = []
    for name, kind in actors.items():
        outs: dict[str, list[str]] = {}
        for src, out, dst in edges:
            if src == name:
                outs.setdefault(out, []).append(dst)
        sent = "; ".join(f"{o} -> {', '.join(d)}" for o, d in outs.items()) or "(no outputs connected)"
        lines.append(f"  {name:<{width}}  {kind:<10}  {sent}")
    lines.append(f"  the run ends once {', '.join(stop_after) if stop_after else 'every actor'} has returned")
    return lines
