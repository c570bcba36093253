"""``python -m pipeline.serving.router_guard CMD...``: run the router (``CMD``) as a child and end it when bridle is
gone.

Every engine process runs in its own session, so that a Ctrl-C in the terminal reaches bridle first and bridle stops
them in order. Then nothing stops them when bridle itself is killed (SIGKILL): the embedded engine polls its parent
for that (:mod:`pipeline.serving.embedded.server`), but the router cannot, as its Rust server holds the GIL and a
watcher thread in its Python process never runs. This guard does it from outside: once a second it checks whether its
parent changed, and then stops the router. SIGTERM and SIGINT are passed on. It ends as the router ended: with its
exit status, or killed by the same signal, so the engine watchdog reports the router's own fate.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from types import FrameType


def _end_like(code: int) -> None:
    if code >= 0:
        sys.exit(code)
    with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP keep their default action anyway
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
    sys.exit(128 - code)  # a signal whose default action does not end the process


def _stop(child: subprocess.Popen) -> int:
    child.terminate()
    try:
        return child.wait(timeout=15)
    except subprocess.TimeoutExpired:
        child.kill()
        return child.wait()


def main(cmd: list[str]) -> None:
    if not cmd:
        sys.exit("usage: python -m pipeline.serving.router_guard CMD [ARGS...]")
    parent = os.getppid()
    child = subprocess.Popen(cmd)

    def forward(sig: int, _frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    while True:
        try:
            code = child.wait(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != parent:  # orphaned: whoever started us is gone
            code = _stop(child)
            break
    _end_like(code)


if __name__ == "__main__":
    main(sys.argv[1:])
