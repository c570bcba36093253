"""Where the display goes: a rich Live area on a terminal, or occasional progress log lines off one (CI, pipes).

The live area is drawn on the Console the console log handler prints to (pipeline.core.logs.console), so every
log line is printed above it and the area is redrawn in place below; it is redrawn on ``tick`` only (the monitor
ticks every ``[monitor].refresh_s``), not by a rich thread, so a changed refresh_s applies at the next tick.
"""

from __future__ import annotations

from typing import Any, Literal

from rich.console import Console
from rich.live import Live

from pipeline.monitor.display import phase, progress_fields, progresses, render
from pipeline.monitor.state import MonitorState

Display = Literal["auto", "log", "off"]


class LiveView:
    def __init__(self, console: Console) -> None:
        # stdout is not redirected: it stays machine-readable (run.py prints JSON there); stderr writes of other
        # libraries go above the live area like the log lines.
        self.live = Live(console=console, auto_refresh=False, redirect_stdout=False, redirect_stderr=True,
                         transient=False)
        self._bars_were_on: bool | None = None

    def start(self, s: MonitorState, now: float) -> None:
        self._bars_were_on = _hf_progress_bars(False)
        self.live.update(render(s, now))
        self.live.start(refresh=True)

    def tick(self, s: MonitorState, now: float) -> None:
        self.live.update(render(s, now), refresh=True)

    def close(self, s: MonitorState, now: float) -> None:
        self.live.update(render(s, now))
        self.live.stop()  # leaves the last frame on the screen, the log lines that follow print below it
        if self._bars_were_on:
            _hf_progress_bars(True)


class LogView:
    """A progress log line when the phase changes, and at most every ``every_s`` seconds while items finish."""

    def __init__(self, log: Any, every_s: float) -> None:
        self.log = log
        self.every_s = every_s
        self._last_t = float("-inf")
        self._last_key: tuple[Any, ...] = ()

    def start(self, s: MonitorState, now: float) -> None:
        self._last_key = _key(s, now)  # nothing to say before anything happened

    def tick(self, s: MonitorState, now: float, *, final: bool = False) -> None:
        key = _key(s, now)
        if key == self._last_key:
            return
        if final or key[0] != self._last_key[0] or now - self._last_t >= self.every_s:
            self.log.info("progress", **progress_fields(s, now))
            self._last_key, self._last_t = key, now

    def close(self, s: MonitorState, now: float) -> None:
        self.tick(s, now, final=True)


def _key(s: MonitorState, now: float) -> tuple[Any, ...]:
    return (phase(s), *(p.done for p in progresses(s, now)))


def open_view(display: Display, console: Console, log: Any, progress_s: float) -> LiveView | LogView | None:
    """``auto``: live on a terminal, log lines otherwise; ``log``: log lines; ``off``: neither (the per-step log
    line and metrics.jsonl stay)."""
    if display == "off":
        return None
    if display == "auto" and console.is_terminal:
        return LiveView(console)
    return LogView(log, progress_s)


def _hf_progress_bars(on: bool) -> bool | None:
    """Turn transformers' tqdm bars (one per weight save or load) on or off; returns whether they were on.

    A tqdm bar redraws itself with carriage returns, which above a live area become a stack of lines per save.
    """
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return None
    was = hf_logging.is_progress_bar_enabled()
    if on:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    return was
