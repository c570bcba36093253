"""What a test needs from outside (Docker, a harness binary): skip on a laptop, fail in CI (CI=true)."""

import os
import shutil

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(condition: bool, why: str) -> None:
    """Skip on a developer's machine when something external is missing; in CI (CI=true) fail instead."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"required in CI: {why}")
    pytest.skip(why)


def require_binary(name: str) -> str:
    path = shutil.which(name)
    require(path is not None, f"{name} is not installed")
    return path  # type: ignore[return-value]
