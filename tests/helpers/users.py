"""Acting as the sandbox's unprivileged user (65534) from a root test: root bypasses the permissions under test."""

from __future__ import annotations

import os
from collections.abc import Callable


def as_nobody(fn: Callable[[], object]) -> bool:
    """``fn()``'s truth, computed in a forked child running as uid/gid 65534."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 4
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            code = 0 if fn() else 3
        finally:
            os._exit(code)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    assert code in (0, 3), f"the child failed ({code})"
    return code == 0
