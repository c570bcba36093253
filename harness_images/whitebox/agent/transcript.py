"""The episode's JSONL record: one event per line, flushed as it happens, so a killed harness leaves a
readable transcript up to its last step.

Events: ``start`` (config, realizations, system prompt, offered tools), ``request`` (per model call: label,
segment, message roles and sizes), ``response``, ``tool`` (offered and canonical name, arguments, raw output,
the observation the model saw), ``plan``, ``verification``, ``summary``, ``segment`` and ``end``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


class Transcript:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", encoding="utf-8")

    def write(self, event: str, **fields: object) -> None:
        self.file.write(
            json.dumps({"event": event, "t": round(time.time(), 3), **fields}, ensure_ascii=False)
        )
        self.file.write("\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
