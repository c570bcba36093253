"""O: the same tool result as the model sees it under O0 (raw), O1 (simulated infrastructure) or O2
(execution metadata)."""

from __future__ import annotations

from .tools import ToolResult


def observe(level: int, result: ToolResult, name: str, seq: int, duration_ms: int) -> str:
    """The same tool result as the model sees it under O<level>."""
    if level == 0:
        return result.output
    status = "ok" if result.ok else "failed"
    if level == 1:
        return (
            f"[sandbox-runner] job {seq:04d} scheduled on worker-1\n"
            f"[sandbox-runner] exec {name}; streaming output\n"
            f"{result.output}\n"
            f"[sandbox-runner] job {seq:04d} {status}; released worker-1"
        )
    return (
        f"--- execution metadata ---\ntool: {name}\nstatus: {status}\nexit_code: {result.exit_code}\n"
        f"duration_ms: {duration_ms}\noutput_chars: {len(result.output)}\n--- output ---\n{result.output}"
    )
