"""Image build inputs, without Docker: what goes into a build context and its key."""

from __future__ import annotations

import re

from pipeline.core.paths import HARNESS_IMAGES
from pipeline.rollout.images import _key, context_files

WHITEBOX = HARNESS_IMAGES / "whitebox"


def test_whitebox_context_is_the_script_and_the_whole_package():
    files = context_files(WHITEBOX)
    package = {f"agent/{p.name}" for p in (WHITEBOX / "agent").iterdir() if p.is_file()}
    assert {"Dockerfile", "harness.py", "agent/__init__.py", "agent/components.py", "agent/tools.json"} <= set(files)
    assert package <= set(files)
    assert not any("__pycache__" in name for name in files)


def test_whitebox_dockerfile_copies_the_script_and_the_package():
    """What the image holds is what ``harness.py`` needs when it runs alone (test_whitebox.py runs such a copy)."""
    copies = re.findall(r"^COPY (.+) /opt/bridle/whitebox/", (WHITEBOX / "Dockerfile").read_text(), re.MULTILINE)
    assert sorted(src for line in copies for src in line.split()) == ["agent/", "harness.py"]


def test_key_follows_every_package_file_but_not_bytecode(tmp_path):
    ctx = tmp_path / "ctx"
    (ctx / "agent" / "__pycache__").mkdir(parents=True)
    (ctx / "Dockerfile").write_text("FROM x\n")
    (ctx / "harness.py").write_text("print()\n")
    (ctx / "agent" / "tools.py").write_text("A = 1\n")

    def key() -> str:
        return _key(ctx / "Dockerfile", context_files(ctx), "parent-id")

    before = key()
    (ctx / "agent" / "__pycache__" / "tools.cpython-311.pyc").write_bytes(b"\0bytecode")
    assert key() == before
    (ctx / "agent" / "tools.py").write_text("A = 2\n")
    assert key() != before


def fake_npm(tmp_path):
    """A node_modules as npm lays it out: app -> a, b; a -> c (nested copy under a/), b -> c (hoisted); d unused."""
    import json

    mods = tmp_path / "node_modules"
    pkgs = {
        "node_modules/app": {"dependencies": {"a": "1", "b": "1"}, "optionalDependencies": {"gone": "1"}},
        "node_modules/a": {"dependencies": {"c": "2"}},
        "node_modules/a/node_modules/c": {},
        "node_modules/b": {"dependencies": {"c": "1"}, "peerDependencies": {"d2": "1"}},
        "node_modules/c": {},
        "node_modules/d": {},
        "node_modules/d2": {},
    }
    for rel in pkgs:
        (tmp_path / rel).mkdir(parents=True, exist_ok=True)
        (tmp_path / rel / "index.js").write_text(f"// {rel}\n")
    (mods / "app" / "bin").mkdir()
    (mods / "app" / "bin" / "cli.js").write_text("#!/usr/bin/env node\n")
    (mods / "app" / "bin" / "cli.js").chmod(0o700)  # owner-only: the image must open it to every user
    (mods / "app" / "link.js").symlink_to("index.js")
    (mods / ".package-lock.json").write_text(json.dumps({"packages": {"": {}, **pkgs}}))
    return mods


def test_dependency_closure_resolves_like_node(tmp_path):
    from pipeline.rollout.images import dependency_closure

    mods = fake_npm(tmp_path)
    assert dependency_closure(mods, "app") == [
        "node_modules/a", "node_modules/a/node_modules/c", "node_modules/app", "node_modules/b", "node_modules/c",
        "node_modules/d2"]  # not d (unused), not the optional dependency that was never installed


def test_closure_tree_lays_out_each_package_once_and_keys_by_manifest(tmp_path):
    import os

    from pipeline.rollout.images import FileTree, _lay_out_context, closure_tree

    mods = fake_npm(tmp_path)
    tree = closure_tree(mods, "app")
    assert "app/index.js" in tree.files and "a/node_modules/c/index.js" in tree.files
    assert not any(k.startswith("d/") for k in tree.files)
    assert sum(k.startswith("a/") for k in tree.files) == 2  # a's own file and its nested c, once each
    before = tree.signature()
    out = tmp_path / "ctx"
    _lay_out_context({"node_modules": tree}, out)
    cli = out / "node_modules" / "app" / "bin" / "cli.js"
    assert cli.stat().st_mode & 0o777 == 0o755  # readable and executable by every user: a copy, fixed
    assert (mods / "app" / "bin" / "cli.js").stat().st_mode & 0o777 == 0o700  # the npm install is untouched
    assert os.readlink(out / "node_modules" / "app" / "link.js") == "index.js"
    assert (out / "node_modules" / "c" / "index.js").samefile(mods / "c" / "index.js")  # hard link, no copy
    assert FileTree(closure_tree(mods, "app").files).signature() == before
    (mods / "b" / "index.js").write_text("// changed, longer\n")
    assert closure_tree(mods, "app").signature() != before


def test_every_npm_image_input_is_declared_by_its_adapter():
    from pipeline.rollout.harnesses import HARNESSES

    for name in ("claude-code", "codex", "qwen-code", "openclaw"):
        h = HARNESSES[name]
        assert h.image and h.image_inputs and h.npm_packages[-1] == h.npm_package
        dockerfile = (HARNESS_IMAGES / name / "Dockerfile").read_text()
        assert all(f"COPY {i.name}" in dockerfile or f" {i.name} " in dockerfile for i in h.image_inputs), name
        assert bool(h.container_node) == h.needs_node
