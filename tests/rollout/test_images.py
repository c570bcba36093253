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
