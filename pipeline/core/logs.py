"""structlog set-up: JSON lines to the run's log file, readable lines on the console.

Library code gets a logger with ``get_logger(actor=..., rollout=...)``; never ``print``.

On a terminal the console lines are printed through one rich Console (:func:`console`): a live display drawn on
that Console (the monitor's) stays in place at the bottom while the log lines scroll above it. Off a terminal
they are plain lines on stderr.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import structlog
from rich.console import Console
from rich.text import Text

_configured = False
_console: Console | None = None


def console() -> Console:
    """The Console (on stderr) that console log lines go to; draw live displays on it."""
    global _console
    if _console is None:
        _console = _stderr_console()
    return _console


def _stderr_console() -> Console:
    # A terminal is what isatty says, as before rich: FORCE_COLOR in a CI job must not start a live display.
    return Console(stderr=True, force_terminal=sys.stderr.isatty())


class _ConsoleHandler(logging.Handler):
    """Prints each formatted record through a rich Console, which places it above any live display."""

    def __init__(self, target: Console) -> None:
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            # soft_wrap: the terminal wraps a long line, rich does not cut it at the console width
            self.target.print(Text.from_ansi(line), soft_wrap=True, highlight=False)
        except Exception:  # noqa: BLE001 — logging's contract: a failing handler reports and never raises
            self.handleError(record)


def configure(log_file: Path | None = None, level: str = "info", console: bool = True) -> None:
    """Route structlog through stdlib logging: one JSON handler (file) and one console handler (stderr)."""
    global _configured, _console
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    root.setLevel(level.upper())
    if console:
        _console = _stderr_console()
        handler = _ConsoleHandler(_console) if _console.is_terminal else logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                processors=[
                    structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.dev.ConsoleRenderer(
                        colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback
                    ),
                ],
                foreign_pre_chain=shared,
            )
        )
        root.addHandler(handler)
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(log_file, encoding="utf-8")
        fh.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                processors=[
                    structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.dict_tracebacks,
                    structlog.processors.JSONRenderer(),
                ],
                foreign_pre_chain=shared,
            )
        )
        root.addHandler(fh)
    _configured = True


def get_logger(**bound: Any) -> Any:
    """A lazy logger: it binds on each use, so module-level loggers follow :func:`configure` called later."""
    return structlog.get_logger("bridle", **bound)
