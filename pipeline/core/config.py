"""Experiment files: TOML, one section per actor, decoded into msgspec Structs.

An experiment file has two fixed sections and one section per actor::

    [experiment]                  # name, seed, where runs go
    [graph]                       # which actors run (name -> kind) and how their outputs connect
    actors = { source = "actors.toy:Source", sink = "actors.toy:Sink" }
    edges = ["source.out -> sink"]
    [source]                      # decoded with the Config struct of the actor class named by its kind
    count = 10

Every field of an actor's Config is either hot-reloadable (listed in the class's ``reloadable`` set) or fixed.
A reload that touches a fixed field is refused as a whole, so nothing is ever half-applied.
"""

from __future__ import annotations

import difflib
import math
import re
import tomllib
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from pipeline.core import graphs
from pipeline.core.paths import CONFIG_DIR


class ConfigError(Exception):
    """A config problem, phrased for the user: which file, which field, what was expected."""


# Bounded field types: a value outside the bound is refused when the file is read, with the field named
# ("[scheduler].group_size: expected int >= 1"), instead of a hang or a ZeroDivisionError at run time.
PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every config section. Subclasses list their hot-reloadable fields in ``reloadable``.

    ``check`` is for invariants that span sections (the other section is found by its actor kind with
    :meth:`Experiment.kind_section`); it raises :class:`ConfigError` naming both fields.
    """

    reloadable: ClassVar[frozenset[str]] = frozenset()

    def check(self, name: str, exp: Experiment) -> None:
        """Cross-section invariants of this section, checked once every section is decoded."""


class ExperimentSection(Section):
    name: str = ""  # names the run folder (runs/<time>-<name>)
    # The run's seed: what every actor's own seed is unless its section sets one (SEEDED): the scheduler's task
    # order and sampling seeds, each training stage's, the evaluator's. Task sets keep their own (a task set is data).
    seed: int = 0
    runs_dir: str = "runs"  # where run folders go
    log_level: Literal["debug", "info", "warning", "error"] = "info"  # log.jsonl's and the terminal's
    description: str = ""  # one line saying what the experiment is; --validate prints it
    # Build a small CPU policy at [run].model before the run if it is missing (pipeline.models.quickstart.ModelSpec
    # fields other than path).
    build_model: dict[str, Any] = msgspec.field(default_factory=dict)


class RunSection(Section):
    """``[run]``: what every actor of a training run agrees on. Set here once; no actor section repeats it."""

    model: str = ""  # HF folder of the initial policy: the engine serves it, the learner trains it
    steps: NonNegInt = 10  # RL steps; the learner stops after the last one
    groups_per_step: PosInt = 2  # (task, harness) groups trained in one RL step
    # A group issued when the learner had done s steps is trained by step s + max_staleness: the scheduler waits
    # before issuing further ahead, and the learner drops what is older (a backstop).
    max_staleness: NonNegInt = 1
    # DAPO's dynamic sampling (docs/learner.md, "When a step cannot learn"). 0: off. N > 0: a training group whose
    # rollouts all scored alike is not trained; the learner asks the scheduler for another group in its place (a
    # new task, the same harness), up to N times per slot of a step, so a step trains groups_per_step groups with a
    # reward spread where it can. Needs the edge "<learner>.resample -> <scheduler>".
    dynamic_sampling: NonNegInt = 0
    reloadable = frozenset({"max_staleness"})

    @property
    def total_groups(self) -> int:
        return self.steps * self.groups_per_step


class GraphSection(Section):
    actors: dict[str, str] = msgspec.field(default_factory=dict)  # actor name -> kind (registry key or mod:Class)
    edges: list[str] = msgspec.field(default_factory=list)  # "actor.output -> actor"
    queue_size: PosInt = 64  # default bound of every inbox
    inbox_sizes: dict[str, PosInt] = msgspec.field(default_factory=dict)  # per-actor override
    # The run is complete once all of these actors returned: the others are then stopped (a cyclic graph such
    # as scheduler -> ... -> learner -> scheduler never drains by itself). Empty: run until every actor returned.
    stop_after: list[str] = msgspec.field(default_factory=list)

    def parsed_edges(self) -> list[tuple[str, str, str]]:
        out = []
        for e in self.edges:
            m = re.fullmatch(r"\s*([\w-]+)\.([\w-]+)\s*->\s*([\w-]+)\s*", e)
            if not m:
                raise ConfigError(f'[graph].edges: "{e}" is not of the form "actor.output -> actor"')
            out.append((m.group(1), m.group(2), m.group(3)))
        return out


FIXED_SECTIONS = ("experiment", "graph")
SHARED_SECTIONS = ("run",)  # read by every actor (ActorContext.run); reloadable fields reach all of them


@dataclass
class Experiment:
    """A validated experiment: the fixed sections plus one typed section per actor."""

    source: str  # file path (or "<dict>") for error messages
    experiment: ExperimentSection
    graph: GraphSection
    sections: dict[str, Section]
    overrides: list[str] = field(default_factory=list)
    run: RunSection = field(default_factory=RunSection)
    preset: str | None = None  # the graph preset [graph] named (pipeline/core/graphs.py); None: a custom graph

    @property
    def name(self) -> str:
        return self.experiment.name or Path(self.source).stem

    def section(self, name: str) -> Section:
        return self.sections[name]

    def kind_section(self, kind: str) -> tuple[str, Section] | None:
        """(name, section) of the one actor of ``kind`` in the graph, or None; for cross-section checks."""
        names = [n for n, k in self.graph.actors.items() if k == kind]
        return (names[0], self.sections[names[0]]) if len(names) == 1 else None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "experiment": msgspec.to_builtins(self.experiment),
            "graph": msgspec.to_builtins(self.graph),
            "run": msgspec.to_builtins(self.run),
        }
        for k, v in self.sections.items():
            d[k] = msgspec.to_builtins(v)
        return d

    def to_toml(self) -> str:
        import tomli_w

        return tomli_w.dumps(_drop_none(self.to_dict()))


def _drop_none(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _drop_none(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_drop_none(v) for v in x]
    return x


def resolve_experiment_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        if not p.exists():
            raise ConfigError(f"{p}: no such experiment file")
        return p
    q = CONFIG_DIR / f"{name_or_path}.toml"
    if not q.exists():
        known = ", ".join(sorted(x.stem for x in CONFIG_DIR.glob("*.toml")))
        raise ConfigError(f'experiment "{name_or_path}": no file {q}; known experiments: {known}')
    return q


def parse_override(text: str) -> tuple[list[str], Any]:
    """``section.field=value`` -> (["section", "field"], value). The value is read as TOML, else as a string."""
    if "=" not in text:
        raise ConfigError(f'--set {text}: expected "section.field=value"')
    key, raw = text.split("=", 1)
    parts = [p.strip() for p in key.strip().split(".")]
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f'--set {text}: expected "section.field=value" (e.g. learner.lr=1e-6)')
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return parts, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for o in overrides:
        parts, value = parse_override(o)
        node = raw
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {o}: {'.'.join(parts[:-1])} is a value, not a section")
            node = nxt
        node[parts[-1]] = value
    return raw


_AT = re.compile(r"^(.*?)(?: - at `\$(.*)`)?$", re.DOTALL)
_UNKNOWN = re.compile(r"^Object contains unknown field (\S+)$")
_ENUM = re.compile(r"^Invalid enum value ")


def _struct_at(typ: Any, path: list[str]) -> Any:
    """The type of the field at ``path`` (field names; list indices dropped) inside Struct ``typ``, or None."""
    for name in path:
        struct = _struct_in(typ)
        if struct is None:
            return None
        typ = next((f.type for f in msgspec.structs.fields(struct) if f.encode_name == name), None)
    return typ


def _struct_in(typ: Any) -> Any:
    """``typ`` itself when it is a Struct, else the Struct inside an Optional / union / Annotated, or None."""
    if isinstance(typ, type) and issubclass(typ, msgspec.Struct):
        return typ
    for arg in typing.get_args(typ):
        if (found := _struct_in(arg)) is not None:
            return found
    return None


def _literals(typ: Any) -> list[Any]:
    if typing.get_origin(typ) is Literal:
        return list(typing.get_args(typ))
    return [v for arg in typing.get_args(typ) for v in _literals(arg)]


def _hint(typ: type, path: list[str], what: str, section: str = "") -> tuple[str, str | None]:
    """(what to add to the message, the unknown field's name or None): close names for an unknown field, the
    allowed values for a wrong one."""
    if (m := _UNKNOWN.match(what)) is not None:
        name = m.group(1)
        struct = _struct_in(_struct_at(typ, path))
        if struct is None:
            return "", name
        if struct is not RunSection and name in {f.encode_name for f in msgspec.structs.fields(RunSection)}:
            return f"; it is set once for every actor, in [run] ({name} = ...)", name
        known = [f.encode_name for f in msgspec.structs.fields(struct)]
        # the fields of its tables too, by their dotted names ([learner.train] lr is optimizer.lr)
        nested = {f"{f.encode_name}.{g.encode_name}": g.encode_name for f in msgspec.structs.fields(struct)
                  if (sub := _struct_in(f.type)) is not None for g in msgspec.structs.fields(sub)}
        if inner := [dotted for dotted, leaf in nested.items() if leaf == name]:
            return f"; it is in one of its tables: {' or '.join(inner)}", name
        outer = _struct_in(_struct_at(typ, path[:-1])) if path else None
        if outer is not None and name in {f.encode_name for f in msgspec.structs.fields(outer)}:
            return f"; it is [{'.'.join([section, *path[:-1]])}]'s own: {name}", name
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6) or [
            dotted for leaf in difflib.get_close_matches(name, list(nested.values()), n=3, cutoff=0.6)
            for dotted, other in nested.items() if other == leaf]
        if close:
            return f"; did you mean {' or '.join(close)}?", name
        return f"; its fields are {', '.join(known)}", name
    if _ENUM.match(what) and (allowed := _literals(_struct_at(typ, path))):
        return f"; allowed: {', '.join(map(str, allowed))}", None
    return "", None


def _explain(source: str, section: str, err: msgspec.ValidationError, overrides: list[str], typ: type) -> str:
    m = _AT.match(str(err))
    what, path = (m.group(1), m.group(2) or "") if m else (str(err), "")
    field_path = path.lstrip(".")
    bare = re.sub(r"\[\d+\]", "", field_path)  # list indices dropped: the field names the types are found by
    parts = bare.split(".") if bare else []
    what = what.replace("`", "")
    hint, unknown = _hint(typ, parts, what, section)
    where = f"[{section}]" + (f".{field_path}" if field_path else "")
    what = what[0].lower() + what[1:] + hint
    key = ".".join([section, *parts, *([unknown] if unknown else [])])
    for o in overrides:
        k = o.split("=", 1)[0].strip()
        # an unknown field is the override's own key, or the first part of it that names no field
        if (parts or unknown) and (k == key or (unknown is not None and k.startswith(key + "."))):
            return f"--set {o}: {what} (field {where} in {source})"
    return f"{source}: {where}: {what}"


def _decode(source: str, section: str, data: Any, typ: type, overrides: list[str]) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: [{section}] must be a table, got {type(data).__name__}")
    try:
        return msgspec.convert(data, typ)
    except msgspec.ValidationError as e:
        raise ConfigError(_explain(source, section, e, overrides, typ)) from None


def load_experiment(
    name_or_path: str | Path | dict[str, Any],
    resolve: Callable[[str], type],
    overrides: list[str] | None = None,
    *,
    check: bool = True,
) -> Experiment:
    """Read, override and validate an experiment. ``resolve(kind)`` returns the actor class of a kind. ``check =
    False`` skips the checks across sections (each section is still decoded and bounded): for a graph that is only
    derived from, whose derived graph is checked when it is loaded (``run.py --eval`` drops the learner)."""
    overrides = list(overrides or [])
    source, raw = _read_experiment(name_or_path)
    raw = apply_overrides(raw, overrides)
    try:
        preset = graphs.expand(raw, source)
    except graphs.PresetError as e:
        raise ConfigError(str(e)) from None
    _check_finite(source, raw, overrides)
    exp = _decode(source, "experiment", raw.pop("experiment", {}), ExperimentSection, overrides)
    run = _decode(source, "run", raw.pop("run", {}), RunSection, overrides)
    graph = _decode(source, "graph", raw.pop("graph", {}), GraphSection, overrides)
    _check_graph(source, graph, actor_sections=list(raw))
    sections = {name: _decode_actor_section(source, graph, name, kind, raw.get(name, {}), resolve, overrides)
                for name, kind in graph.actors.items()}
    _seeded(sections, graph.actors, raw, exp.seed)
    out = Experiment(source=source, experiment=exp, graph=graph, sections=sections, overrides=overrides, run=run,
                     preset=preset)
    for name, sec in sections.items() if check else ():
        try:
            sec.check(name, out)
        except ConfigError as e:
            raise ConfigError(_blame_override(str(e), overrides)) from None
    return out


# actor kind -> the tables of its section whose `seed` defaults to [experiment].seed
SEEDED: dict[str, tuple[tuple[str, ...], ...]] = {
    "scheduler": ((),),
    "learner": (("train",), ("sft",)),
    "evaluator": ((),),
}


def _seeded(sections: dict[str, Section], kinds: dict[str, str], raw: dict[str, Any], seed: int) -> None:
    """Give every seed (SEEDED) that an actor's section leaves unset in the file the experiment's, in place."""
    for name, kind in kinds.items():
        for path in SEEDED.get(kind, ()):
            given: Any = raw.get(name, {})
            for part in path:
                given = given.get(part, {}) if isinstance(given, dict) else {}
            if isinstance(given, dict) and "seed" in given:
                continue
            sections[name] = _replace_at(sections[name], path, seed)


def _replace_at(struct: Any, path: tuple[str, ...], seed: int) -> Any:
    if not path:
        return msgspec.structs.replace(struct, seed=seed)
    return msgspec.structs.replace(struct, **{path[0]: _replace_at(getattr(struct, path[0]), path[1:], seed)})


def model_folder_problem(model: str, *, build: bool) -> str:
    """What is wrong with ``[run].model`` as a folder ("" when nothing). Built (``[experiment.build_model]``): absent,
    empty or a model bridle built there, never a folder of the user's. Otherwise: a Hugging Face model folder."""
    out = Path(model)
    if build:
        if not out.exists() or (out.is_dir() and ((out / "bridle_model.json").is_file() or not any(out.iterdir()))):
            return ""
        what = ("a file" if not out.is_dir() else "a model bridle did not build" if (out / "config.json").is_file()
                else "files that are not a model")
        return (f"[run].model = {model!r} holds {what}; [experiment.build_model] builds a small policy there and "
                "never writes over a folder of yours: remove [experiment.build_model] to train that model, or point "
                "[run].model at a new folder")
    if not out.is_dir():
        return (f"[run].model = {model!r}: no such folder; give a local Hugging Face model folder (config.json, "
                "weights, tokenizer), or add [experiment.build_model] to build a small CPU policy there")
    if not (out / "config.json").is_file():
        return f"[run].model = {model!r}: not a Hugging Face model folder (no config.json in it)"
    return ""


def _check_finite(source: str, raw: dict[str, Any], overrides: list[str]) -> None:
    """No setting is NaN or infinite (TOML writes them ``nan`` and ``inf``): a NaN coefficient or learning rate
    would silently destroy the policy, an infinite one too, and no bound can be checked against NaN."""
    stack: list[tuple[str, Any]] = [(k, v) for k, v in raw.items()]
    while stack:
        key, v = stack.pop()
        if isinstance(v, dict):
            stack += [(f"{key}.{k}", x) for k, x in v.items()]
        elif isinstance(v, list):
            stack += [(f"{key}[{i}]", x) for i, x in enumerate(v)]
        elif isinstance(v, float) and not math.isfinite(v):
            table, _, field = key.partition(".")
            where = f"[{table}].{field}" if field else key
            given = [o for o in overrides if o.split("=", 1)[0].strip() == key.split("[", 1)[0]]
            origin = f"--set {given[0]}" if given else source
            raise ConfigError(f"{origin}: {where} = {v}: settings must be finite numbers")


def _blame_override(msg: str, overrides: list[str]) -> str:
    """A section check's message, saying which --set gave the fields it names (the file did not): its own or
    another section's it was compared with, written ``[a].b`` or ``[a.b] c``."""
    blamed = []
    for o in overrides:
        parts = o.split("=", 1)[0].strip().split(".")
        for i in range(1, len(parts)):
            table, key = ".".join(parts[:i]), ".".join(parts[i:])
            if f"[{table}].{key}" in msg or f"[{table}] {key}" in msg:
                blamed.append(f"--set {o}")
                break
    return f"{msg} (from {', '.join(blamed)})" if blamed else msg


def _read_experiment(name_or_path: str | Path | dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(source, the raw tables): a dict as given, else the TOML file the name or path resolves to."""
    if isinstance(name_or_path, dict):
        return "<dict>", dict(name_or_path)
    path = resolve_experiment_path(str(name_or_path))
    try:
        return str(path), tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r}); an "
                          "experiment file is TOML, which is UTF-8") from None


def _check_graph(source: str, graph: GraphSection, actor_sections: list[str]) -> None:
    """Every actor the edges and stop_after name exists, and every remaining section belongs to an actor."""
    if not graph.actors:
        raise ConfigError(f"{source}: [graph].actors is empty; name at least one actor, e.g. actors = {{ a = \"kind\" }}, "
                          f"or a preset: {', '.join(graphs.PRESETS)}")
    names = set(graph.actors)
    for src, _out, dst in graph.parsed_edges():
        for n in (src, dst):
            if n not in names:
                raise ConfigError(f"{source}: [graph].edges names actor \"{n}\", which is not in [graph].actors")
    for n in graph.stop_after:
        if n not in names:
            raise ConfigError(f"{source}: [graph].stop_after names actor \"{n}\", which is not in [graph].actors")
    if not graph.stop_after and (cycle := _cycle(graph)):
        raise ConfigError(f"{source}: [graph].stop_after is empty, and the edges make a cycle ({' -> '.join(cycle)}), "
                          "which never drains by itself: the run would never end; name the actors whose end ends "
                          'the run, e.g. stop_after = ["learner"]')
    for n in graph.inbox_sizes:
        if n not in names:
            raise ConfigError(f"{source}: [graph].inbox_sizes names actor \"{n}\", which is not in [graph].actors "
                              f"({', '.join(sorted(names))})")
    for name in actor_sections:
        if name not in names:
            raise ConfigError(
                f"{source}: unknown section [{name}]; sections are [experiment], [graph], [run] and one per actor "
                f"in [graph].actors ({', '.join(sorted(names))}){SECTION_HINTS.get(name, '')}"
            )


def _cycle(graph: GraphSection) -> list[str]:
    """One cycle of the graph's edges as actor names (first name repeated at the end); [] when it has none."""
    succ: dict[str, list[str]] = {}
    for src, _out, dst in graph.parsed_edges():
        succ.setdefault(src, []).append(dst)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(succ):
        if state.get(start):
            continue
        path, stack = [start], [iter(succ.get(start, []))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(succ.get(nxt, [])))
    return []


# Sections people look for that are tables of an actor's section instead.
SECTION_HINTS = {
    "verifier": "; the sandbox actor runs the verifiers: the rubric judge is its table [sandbox.judge] "
                "(docs/rollout.md, Judge)",
    "judge": "; the rubric judge is a table of the sandbox actor's section: [sandbox.judge] (docs/rollout.md, Judge)",
}


def _decode_actor_section(source: str, graph: GraphSection, name: str, kind: str, raw: Any,
                          resolve: Callable[[str], type], overrides: list[str]) -> Section:
    """Actor ``name``'s section, decoded with its kind's Config; its outgoing edges must name its outputs."""
    try:
        cls = resolve(kind)
    except (KeyError, ImportError, AttributeError, TypeError) as e:
        raise ConfigError(f"{source}: [graph].actors.{name}: unknown actor kind \"{kind}\" ({e})") from None
    section = _decode(source, name, raw, cls.Config, overrides)
    for src, out, _dst in graph.parsed_edges():
        if src == name and out not in cls.outputs:
            raise ConfigError(
                f"{source}: [graph].edges: actor \"{name}\" ({kind}) has no output \"{out}\"; "
                f"its outputs are {', '.join(cls.outputs) or 'none'}"
            )
    return section


@dataclass
class ConfigDiff:
    changes: dict[str, dict[str, Any]]  # section -> field -> new value (only sections that changed)
    refused: list[str]  # "[section].field" of fixed fields that changed

    @property
    def empty(self) -> bool:
        return not self.changes and not self.refused


def diff(old: Experiment, new: Experiment) -> ConfigDiff:
    changes: dict[str, dict[str, Any]] = {}
    refused: list[str] = []
    for sec in FIXED_SECTIONS:
        a, b = msgspec.to_builtins(getattr(old, sec)), msgspec.to_builtins(getattr(new, sec))
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                refused.append(f"[{sec}].{k}")
    if refused:
        return ConfigDiff({}, refused)
    pairs = [("run", old.run, new.run)] + [(n, old.sections[n], s) for n, s in new.sections.items()]
    for name, sec_old, sec_new in pairs:
        if type(sec_old) is not type(sec_new):
            refused.append(f"[{name}]")
            continue
        a, b = msgspec.to_builtins(sec_old), msgspec.to_builtins(sec_new)
        changed = {k: b.get(k) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
        if not changed:
            continue
        for k in changed:
            if k not in type(sec_new).reloadable:
                refused.append(f"[{name}].{k}")
        changes[name] = changed
    if refused:
        return ConfigDiff({}, refused)
    return ConfigDiff(changes, [])
