"""Config editing: change or add settings in a JSON or INI file; every other setting must stay as it was."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

from pipeline.rollout.taskgen.common import act, build_task, rng_for
from pipeline.rollout.tasks import OracleAction, TaskSpec

FAMILY = "config_edit"
DIFFICULTY = "easy"
DESCRIPTION = "change or add keys in a JSON or INI config file, leaving the rest untouched"

# Key names are unique across sections and none is a suffix of another, so "key = value" text is unique.
_SECTIONS: dict[str, dict[str, Any]] = {
    "server": {
        "host": ["0.0.0.0", "127.0.0.1", "localhost"],
        "port": [8000, 8080, 9000, 3000, 5000],
        "workers": [1, 2, 4, 8],
    },
    "database": {
        "db_name": ["app", "main", "prod", "test"],
        "pool_size": [5, 10, 20, 50],
        "timeout_s": [10, 30, 60],
    },
    "logging": {
        "level": ["debug", "info", "warning", "error"],
        "log_file": ["app.log", "out.log", "run.log"],
        "rotate": [True, False],
    },
    "cache": {"ttl": [60, 300, 3600], "max_items": [100, 1000, 5000], "enabled": [True, False]},
}
_NEW_KEYS: dict[str, tuple[str, list[Any]]] = {
    "server": ("keepalive", [5, 15, 75]),
    "database": ("retries", [1, 3, 5]),
    "logging": ("colors", [True, False]),
    "cache": ("eviction", ["lru", "lfu", "fifo"]),
}


def _ini_value(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def _render_ini(cfg: dict[str, dict[str, Any]]) -> str:
    return "\n".join(
        f"[{s}]\n" + "".join(f"{k} = {_ini_value(v)}\n" for k, v in kv.items()) for s, kv in cfg.items()
    )


def _other(rng: random.Random, options: list[Any], current: Any) -> Any:
    return rng.choice([o for o in options if o != current])


def generate(seed: int) -> TaskSpec:
    rng = rng_for(FAMILY, seed)
    fmt = rng.choice(["json", "ini"])
    sections = rng.sample(list(_SECTIONS), rng.randint(2, 4))
    cfg = {s: {k: rng.choice(opts) for k, opts in _SECTIONS[s].items()} for s in sections}
    want = copy.deepcopy(cfg)
    op = rng.choice(["set", "set", "set_two", "add"])
    fname = rng.choice(["config", "settings", "app"]) + (".json" if fmt == "json" else ".ini")

    def lit(v: Any) -> str:
        return json.dumps(v) if fmt == "json" else _ini_value(v)

    def line(k: str, v: Any) -> str:
        return f'"{k}": {json.dumps(v)}' if fmt == "json" else f"{k} = {_ini_value(v)}"

    asks: list[str] = []
    actions: list[OracleAction] = [act("read_file", path=fname)]
    if op in ("set", "set_two"):
        pairs = [(s, k) for s in sections for k in cfg[s]]
        for s, k in rng.sample(pairs, 1 if op == "set" else 2):
            new = _other(rng, _SECTIONS[s][k], cfg[s][k])
            want[s][k] = new
            asks.append(f"set {s}.{k} to {lit(new)}")
            actions.append(act("edit_file", path=fname, old=line(k, cfg[s][k]), new=line(k, new)))
    else:
        s = rng.choice(sections)
        k, opts = _NEW_KEYS[s]
        v = rng.choice(opts)
        want[s][k] = v
        asks.append(f"add the key {k} with value {lit(v)} to the {s} section")
        head = f'"{s}": {{' if fmt == "json" else f"[{s}]"
        sep = "\n    " if fmt == "json" else "\n"
        tail = "," if fmt == "json" else ""
        actions.append(act("edit_file", path=fname, old=head, new=f"{head}{sep}{line(k, v)}{tail}"))

    if fmt == "json":
        text = json.dumps(cfg, indent=2) + "\n"
        check = {"kind": "json", "path": fname, "value": want}
        note = "Keep it valid JSON"
    else:
        text = _render_ini(cfg)
        check = {
            "kind": "ini",
            "path": fname,
            "value": {s: {k: _ini_value(v) for k, v in kv.items()} for s, kv in want.items()},
        }
        note = "Keep it a valid INI file"
    return build_task(
        family=FAMILY,
        seed=seed,
        difficulty=DIFFICULTY,
        instruction=f"In {fname}, {' and '.join(asks)}. {note} and leave every other setting unchanged.",
        workspace={fname: text},
        checks=[check],
        actions=actions,
        category="configuration",
    )
