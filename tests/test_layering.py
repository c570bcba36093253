"""The layout is the architecture: which stage may import which, no import cycles, the library never imports the
actors, and harness code never imports bridle (it talks to us only over HTTP).

Imports inside functions count too: a lazy import is still a dependency."""

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What each stage package of pipeline/ may import besides itself (docs/architecture.md, "Layout"). Lower layers
# first: messages is the map every stage shares; core is the actor framework; the stages; cli runs them all.
ALLOWED = {
    "messages": set(),
    "core": {"messages"},
    "tokens": {"core", "messages"},
    "rollout": {"core", "messages", "harness_images"},  # the white-box harness owns its component definitions
    "trees": {"core", "messages"},
    "training": {"core", "messages"},
    "models": {"core", "messages", "tokens", "rollout", "harness_images"},
    "serving": {"core", "messages", "tokens", "models"},
    "monitor": {"core", "messages"},
    "eval": {"core", "messages", "tokens", "rollout", "trees"},
    "cli": {"core", "messages", "tokens", "rollout", "trees", "training", "models", "serving", "monitor", "eval"},
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Absolute names this file imports (``from a.b import c`` gives a.b and a.b.c)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:
                base = module_name(path).split(".")
                base = base[: len(base) - node.level + (1 if path.name == "__init__.py" else 0)]
                mod = ".".join([*base, node.module])
            else:
                mod = node.module
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def files(top: str) -> list[Path]:
    return sorted((ROOT / top).rglob("*.py"))


def stage(mod: str) -> str:
    return mod.split(".")[1] if mod.count(".") else "__init__"


def test_pipeline_stages_import_only_what_their_layer_allows():
    bad = []
    for f in files("pipeline"):
        mod = module_name(f)
        here = stage(mod)
        if here == "__init__":
            continue
        for imp in imports(f):
            top = imp.split(".")[0]
            if top == "actors":
                bad.append(f"{mod} imports {imp}: the library never imports the actors")
            elif top == "pipeline" and imp.count("."):
                other = stage(imp)
                if other not in (here, "__init__") and other in ALLOWED and other not in ALLOWED[here]:
                    bad.append(f"{mod} imports {imp}: {here} may import {sorted(ALLOWED[here]) or 'nothing'}")
            elif top == "harness_images" and "harness_images" not in ALLOWED.get(here, set()):
                bad.append(f"{mod} imports {imp}")
    assert not bad, "\n".join(bad)


def test_every_stage_package_is_declared():
    stages = {p.name for p in (ROOT / "pipeline").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert stages | {"messages"} == set(ALLOWED)


def test_no_import_cycles_between_modules():
    known = {module_name(f): f for top in ("pipeline", "actors") for f in files(top)}
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, f in known.items():
        for imp in imports(f):
            target = imp if imp in known else imp.rpartition(".")[0]
            if target in known and target != mod and not mod.startswith(target + "."):
                graph[mod].add(target)
    # Packages' __init__ modules re-export their members; an edge into a package is an edge into what it holds,
    # so only module-to-module edges between non-__init__ files are cycles worth naming.
    seen: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        seen[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if seen.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in seen:
                visit(n)
        stack.pop()
        seen[m] = 2

    for m in sorted(known):
        if m not in seen:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_harness_code_never_imports_bridle():
    bad = [f"{f.relative_to(ROOT)} imports {imp}" for f in files("harness_images") for imp in imports(f)
           if imp.split(".")[0] in ("pipeline", "actors")]
    assert not bad, "\n".join(bad)
