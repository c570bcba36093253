"""structlog set-up: JSON lines to the run's log file, readable lines on the console.

Library code gets a logger with ``get_logger(actor=..., rollout=...)``; never ``print``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import structlog

_configured = False


def configure(log_file: Path | None = None, level: str = "info", console: bool = True) -> None:
    """Route structlog through stdlib logging: one JSON handler (file) and one console handler (stderr)."""
    global _configured
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
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(
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
        root.addHandler(h)
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
