"""Waiting in a test on state outside its process (/proc, the Docker engine), which no event can signal."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio

T = TypeVar("T")


async def until(check: Callable[[], T], *, timeout_s: float = 300.0, every_s: float = 0.05) -> T:
    """Call ``check`` every ``every_s`` seconds until it returns something truthy, and return that; fail (instead of
    hanging the suite) after ``timeout_s``."""
    with anyio.fail_after(timeout_s):
        while True:
            if value := check():
                return value
            await anyio.sleep(every_s)
