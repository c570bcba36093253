"""The seven tools, run against the workspace, and the check of the model's arguments.

Canonical names and arguments: ``read_file(path)``, ``write_file(path, content)``,
``edit_file(path, old, new)``, ``bash(command)``, ``python(code)`` (a fresh interpreter per call),
``search(query)`` and ``fetch(url)`` over the local corpus. The T level only renames them
(``components.tool_interface``); what they do never changes.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import ToolError


@dataclass
class ToolResult:
    """What a tool returned: its output (clipped), whether it succeeded, its exit status (1 for errors)."""

    output: str
    ok: bool
    exit_code: int


class Tools:
    """The seven functions, run against the workspace. Argument problems raise ToolError so the model sees
    what it got wrong and can try again."""

    def __init__(self, workspace: Path, corpus: Path, command_timeout: float, max_output_chars: int) -> None:
        self.workspace, self.corpus = workspace, corpus
        self.command_timeout, self.max_output_chars = command_timeout, max_output_chars

    def run(self, canonical: str, args: dict) -> ToolResult:
        try:
            output, code = getattr(self, "_" + canonical)(**args)
        except (ToolError, OSError) as e:  # an unreadable file should reach the model, not end the episode
            return ToolResult(self._clip(f"Error: {e}"), False, 1)
        return ToolResult(self._clip(output), code == 0, code)

    def _clip(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        return text[: self.max_output_chars] + f"\n[... {len(text) - self.max_output_chars} more characters]"

    def _path(self, path: str) -> Path:
        if not path.strip():
            raise ToolError("path is empty")
        return (self.workspace / path).resolve()

    def _read_file(self, path: str) -> tuple[str, int]:
        p = self._path(path)
        if p.is_dir():
            raise ToolError(f"{path} is a directory")
        try:
            return p.read_text(encoding="utf-8", errors="replace"), 0
        except FileNotFoundError:
            raise ToolError(f"{path} does not exist") from None
        except OSError as e:
            raise ToolError(f"cannot read {path}: {e.strerror}") from None

    def _write_file(self, path: str, content: str) -> tuple[str, int]:
        p = self._path(path)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(content, encoding="utf-8")
        except OSError as e:
            raise ToolError(f"cannot write {path}: {e.strerror}") from None
        return f"Wrote {len(content)} characters to {path}.", 0

    def _edit_file(self, path: str, old: str, new: str) -> tuple[str, int]:
        if not old:
            raise ToolError("old is empty; give the exact text to replace")
        text, _ = self._read_file(path)
        count = text.count(old)
        if count == 0:
            raise ToolError(f"old text not found in {path}")
        if count > 1:
            raise ToolError(f"old text occurs {count} times in {path}; include more context")
        try:
            self._path(path).write_text(text.replace(old, new, 1), encoding="utf-8")
        except OSError as e:
            raise ToolError(f"cannot write {path}: {e.strerror}") from None
        return f"Edited {path}.", 0

    def _bash(self, command: str) -> tuple[str, int]:
        shell = shutil.which("bash") or "/bin/sh"
        return self._process([shell, "-c", command], None)

    def _python(self, code: str) -> tuple[str, int]:
        return self._process([sys.executable, "-"], code)

    def _process(self, argv: list[str], stdin_text: str | None) -> tuple[str, int]:
        # Own session, so a timeout kills the command's children too (they would hold the pipe open).
        proc = subprocess.Popen(
            argv,
            cwd=self.workspace,
            stdin=subprocess.PIPE if stdin_text is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(
                stdin_text.encode() if stdin_text is not None else None, timeout=self.command_timeout
            )
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            text = out.decode("utf-8", "replace")
            raise ToolError(f"timed out after {self.command_timeout:g} s; output so far:\n{text}") from None
        text = out.decode("utf-8", "replace")
        if proc.returncode != 0:
            text += f"\n(exit code {proc.returncode})"
        return text, proc.returncode

    def _documents(self) -> list[Path]:
        if not self.corpus.is_dir():
            raise ToolError("there is no local corpus in this workspace")
        return sorted(p for p in self.corpus.rglob("*") if p.is_file() and p.name != "urls.json")

    def _search(self, query: str) -> tuple[str, int]:
        terms = re.findall(r"\w+", query.lower())
        if not terms:
            raise ToolError("query has no words")
        docs = [(p, p.read_text(encoding="utf-8", errors="replace")) for p in self._documents()]
        tokens = {p: re.findall(r"\w+", text.lower()) for p, text in docs}
        n = len(docs)
        scored = []
        for p, text in docs:
            score = 0.0
            for t in set(terms):
                tf = tokens[p].count(t)
                if tf:
                    df = sum(1 for q in tokens if t in tokens[q])
                    score += (1 + math.log(tf)) * math.log(1 + n / df)
            if score > 0:
                scored.append((-score, str(p.relative_to(self.corpus)), text))
        if not scored:
            return f"No documents match {query!r}.", 0
        lines = []
        for _, rel, text in sorted(scored)[:5]:
            low = text.lower()
            at = min((low.find(t) for t in terms if low.find(t) >= 0), default=0)
            snippet = " ".join(text[max(0, at - 60) : at + 140].split())
            lines.append(f"corpus://{rel}\n  {snippet}")
        return "\n".join(lines), 0

    def _fetch(self, url: str) -> tuple[str, int]:
        self._documents()
        rel = None
        index = self.corpus / "urls.json"
        if index.is_file():
            try:
                rel = json.loads(index.read_text(encoding="utf-8")).get(url)
            except (json.JSONDecodeError, AttributeError):
                raise ToolError("the corpus index urls.json is broken") from None
        if rel is None:
            rel = url.removeprefix("corpus://")
        p = (self.corpus / rel).resolve()
        if not p.is_relative_to(self.corpus.resolve()) or not p.is_file():
            raise ToolError(f"{url} is not in the local corpus (there is no network access)")
        return p.read_text(encoding="utf-8", errors="replace"), 0


def parse_arguments(raw: str, expected: list[str]) -> dict:
    """The model's argument JSON, checked against the parameter names (all strings)."""
    try:
        args = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as e:
        raise ToolError(f"arguments are not valid JSON ({e.msg} at position {e.pos})") from None
    if not isinstance(args, dict):
        raise ToolError("arguments must be a JSON object")
    missing = [k for k in expected if k not in args]
    extra = [k for k in args if k not in expected]
    if missing or extra:
        raise ToolError(f"expected arguments {expected}; missing {missing}, unexpected {extra}")
    wrong = [k for k in expected if not isinstance(args[k], str)]
    if wrong:
        raise ToolError(f"arguments {wrong} must be strings")
    return args
