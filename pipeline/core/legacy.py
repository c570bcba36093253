"""Reading what older versions of bridle wrote: experiment files without ``[run]``, event logs of schema 1.

Before ``[run]`` existed, ``steps``, ``groups_per_step`` and ``max_staleness`` were declared in both
``[scheduler]`` and ``[learner]`` ("must be equal", never checked), and the policy's folder in ``[learner].model``,
``[proxy.engine].model`` and ``[experiment.build_model].path``. Such a file (and the config recorded in an old
event log) is migrated when it is read: each value moves to ``[run]`` once, after checking that every copy agrees
(a disagreement is an error naming both fields). A file that has ``[run]`` and still sets one of the old fields is
refused with the field's new place, so nothing is silently ignored.

Schema-1 event logs lack fields later messages carry: a demonstration pack's ``purpose`` on ``GroupDropped``, the
number of packs on demonstration ``TreeGroup``s and ``GroupDropped``s, and each ``TreeGroup``'s sampling
temperature. :func:`upgrade_event` fills them from the log's own recorded config, so an old log replays as it ran.
"""

from __future__ import annotations

from typing import Any

import msgspec

# (actor kind, dotted field inside its section) -> field of [run]
MOVED: dict[tuple[str, str], str] = {
    ("scheduler", "steps"): "steps",
    ("scheduler", "groups_per_step"): "groups_per_step",
    ("scheduler", "max_staleness"): "max_staleness",
    ("learner", "steps"): "steps",
    ("learner", "groups_per_step"): "groups_per_step",
    ("learner", "max_staleness"): "max_staleness",
    ("learner", "model"): "model",
    ("proxy", "engine.model"): "model",
}
# Fields that became derived: computed from other settings (or carried by the messages) instead of set by hand.
DERIVED: dict[tuple[str, str], str] = {
    ("learner", "sft_packs"): "the tree builder counts the demonstration packs and tells the learner",
    ("learner", "train.temperature"): "each TreeGroup carries the temperature its rollouts were sampled at",
    ("learner", "sft.temperature"): "demonstrations are trained as plain NLL",
}


class LegacyError(ValueError):
    """Raised as the config layer's ConfigError by the caller (this module must not import it: no cycle)."""


def _names(raw: dict[str, Any], kind: str) -> list[str]:
    actors = raw.get("graph", {}).get("actors", {})
    return [n for n, k in actors.items() if isinstance(actors, dict) and k == kind]


def _get(section: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = section
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _pop(section: dict[str, Any], dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    node = section
    for part in parents:
        node = node[part]
    del node[leaf]


def _legacy_fields(raw: dict[str, Any]) -> tuple[list[tuple[str, str, str, Any]], list[tuple[str, str, str]]]:
    """((where, section, dotted, value) of moved fields, (where, section, dotted) of derived ones) present in raw."""
    found: list[tuple[str, str, str, Any]] = []
    for kind, dotted in MOVED:
        for name in _names(raw, kind):
            present, value = _get(raw.get(name, {}), dotted)
            # "" is the unset default of a model field (EngineSettings.model stays in recorded configs)
            if present and value != "":
                found.append((f"[{name}].{dotted}", name, dotted, value))
    bm = raw.get("experiment", {}).get("build_model", {})
    if isinstance(bm, dict) and "path" in bm:
        found.append(("[experiment.build_model].path", "experiment", "build_model.path", bm["path"]))
    derived: list[tuple[str, str, str]] = []
    for (kind, dotted) in DERIVED:
        for name in _names(raw, kind):
            if _get(raw.get(name, {}), dotted)[0]:
                derived.append((f"[{name}].{dotted}", name, dotted))
    return found, derived


def _target(raw: dict[str, Any], name: str, dotted: str) -> str:
    return "model" if name == "experiment" else MOVED[(_kind_of(raw, name), dotted)]


def migrate(raw: dict[str, Any], source: str) -> list[str]:
    """Move the legacy fields of ``raw`` (a parsed experiment file without ``[run]``) into ``[run]``, in place.

    Returns one note per change, for the run's log. Raises :class:`LegacyError` naming two copies that disagree.
    A file that has ``[run]`` is left alone here; :func:`refuse_moved` then rejects any old field in it.
    """
    if "run" in raw:
        return []
    found, derived = _legacy_fields(raw)
    if not found and not derived:
        return []
    run: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for where, name, dotted, value in found:
        target = _target(raw, name, dotted)
        if target in run and run[target] != value:
            raise LegacyError(f"{source}: {origin[target]} = {run[target]!r} but {where} = {value!r}; they must be "
                              f"equal (both become [run].{target})")
        run.setdefault(target, value)
        origin.setdefault(target, where)
        _pop(raw[name], dotted)
    for _where, name, dotted in derived:
        _pop(raw[name], dotted)
    raw["run"] = run
    moved = [f"{w} -> [run].{t}" for t, w in origin.items()] + [f"{w} dropped (derived now)" for w, *_ in derived]
    return ["legacy experiment layout migrated: " + ", ".join(moved)]


def refuse_moved(raw: dict[str, Any], source: str) -> None:
    """Raise LegacyError if ``raw`` (migrated, overrides applied) still sets a field that moved or is derived."""
    found, derived = _legacy_fields(raw)
    hints = [f"{w} -> [run].{_target(raw, n, d)}" for w, n, d, _v in found] + [
        f"{w} (derived now: {DERIVED[(_kind_of(raw, n), d)]})" for w, n, d in derived]
    if hints:
        raise LegacyError(f"{source}: these fields moved or are derived now; set them once in [run] and remove them "
                          f"from their old place: {'; '.join(hints)}")


def _kind_of(raw: dict[str, Any], name: str) -> str:
    return raw.get("graph", {}).get("actors", {}).get(name, "")


# ----------------------------------------------------------------------------------------------- event logs
def upgrade_event(msg: Any, schema_version: int, recorded_config: dict[str, Any]) -> Any:
    """A message of an older schema with the fields the current code reads filled in (see the module docstring)."""
    if schema_version >= 2:
        return msg
    from pipeline.messages import GroupDropped, TreeGroup

    if isinstance(msg, (TreeGroup, GroupDropped)) and msg.group_id.startswith("sftpack"):
        # Schema 1 named demonstration packs "sftpack<i>" and the learner waited for [learner].sft_packs of them.
        packs = _learner_field(recorded_config, "sft_packs", 0)
        msg = msgspec.structs.replace(msg, purpose="sft", packs=int(packs))
    if isinstance(msg, TreeGroup) and msg.purpose != "sft":
        t = _learner_field(recorded_config, "train", {}).get("temperature", 1.0)
        msg = msgspec.structs.replace(msg, temperature=float(t))
    return msg


def _learner_field(config: dict[str, Any], field: str, default: Any) -> Any:
    for name, kind in config.get("graph", {}).get("actors", {}).items():
        if kind == "learner":
            return config.get(name, {}).get(field, default)
    return default
