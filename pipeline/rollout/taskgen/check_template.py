"""Hidden checker copied verbatim into every generated task as ``tests/check.py`` (stdlib only).

Usage: ``python3 -I check.py WORKSPACE``. Reads ``expected.json`` next to itself: a list of checks and a secret.
Prints one line per failed check, or ``BRIDLE-PASS <secret>`` when all pass; test.sh grants the reward only on
that exact line, so workspace code that exits early (``sys.exit(0)`` in an imported module) does not pass.

Checks marked ``"partial": true`` also earn graded credit when they fail (a ``text`` check: the share of expected
words at their place). When not everything passes but some credit was earned, the checker prints
``BRIDLE-PARTIAL <secret> <score>`` with ``score = PARTIAL_CAP * mean credit`` (< 1, so only an exact solution
reaches 1): a dense signal for small policies that get the format right before the content.
"""

import configparser
import importlib.util
import io
import json
import pathlib
import sys
import unittest

HERE = pathlib.Path(__file__).resolve().parent
PARTIAL_CAP = 0.8


def credit(ws, c):
    """Graded credit in [0, 1] for a failed check marked partial."""
    if c["kind"] != "text":
        return 0.0
    p = ws / c.get("path", "")
    if not p.is_file():
        return 0.0
    got = p.read_text(encoding="utf-8", errors="replace").split()
    want = c["text"].split()
    if not want:
        return 0.0
    same = sum(1 for a, b in zip(got, want) if a == b)
    return same / max(len(want), len(got))


def _read(ws, rel):
    p = ws / rel
    if not p.is_file():
        raise AssertionError(f"{rel} does not exist")
    return p.read_text(encoding="utf-8", errors="replace")


def _lines(text):
    return [ln.rstrip() for ln in text.rstrip("\n").split("\n")] if text.strip() else []


def check_one(ws, c):
    kind, rel = c["kind"], c.get("path", "")
    if kind == "text":
        got = _read(ws, rel)
        want = c["text"]
        if c.get("match") == "strip":
            got, want = got.strip(), want.strip()
        else:  # one trailing newline is allowed either way
            got, want = got.rstrip("\n"), want.rstrip("\n")
        if got != want:
            raise AssertionError(f"{rel}: content differs (got {got[:80]!r}, want {want[:80]!r})")
    elif kind == "lines":
        got = _lines(_read(ws, rel))
        if got != c["lines"]:
            raise AssertionError(f"{rel}: lines differ (got {got[:5]!r}..., want {c['lines'][:5]!r}...)")
    elif kind == "number":
        raw = _read(ws, rel).strip()
        try:
            got = float(raw)
        except ValueError:
            raise AssertionError(f"{rel}: expected a number, got {raw[:40]!r}") from None
        if abs(got - c["value"]) > c.get("tol", 0.0) + 1e-9:
            raise AssertionError(f"{rel}: got {got}, want {c['value']}")
    elif kind == "absent":
        if (ws / rel).exists():
            raise AssertionError(f"{rel} should not exist")
    elif kind == "dir":
        if not (ws / rel).is_dir():
            raise AssertionError(f"{rel}/ is not a directory")
    elif kind == "json":
        try:
            got = json.loads(_read(ws, rel))
        except json.JSONDecodeError as e:
            raise AssertionError(f"{rel}: not valid JSON ({e})") from None
        if got != c["value"]:
            raise AssertionError(f"{rel}: settings differ from what was asked")
    elif kind == "ini":
        cp = configparser.ConfigParser(interpolation=None)
        try:
            cp.read_string(_read(ws, rel))
        except configparser.Error as e:
            raise AssertionError(f"{rel}: not a valid INI file ({e})") from None
        got = {s: dict(cp[s]) for s in cp.sections()}
        if got != c["value"]:
            raise AssertionError(f"{rel}: settings differ from what was asked")
    elif kind == "unittest":
        sys.path.append(str(ws))  # appended: workspace files cannot shadow the standard library
        spec = importlib.util.spec_from_file_location("hidden_tests", HERE / c["file"])
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        suite = unittest.defaultTestLoader.loadTestsFromModule(mod)
        stream = io.StringIO()
        result = unittest.TextTestRunner(stream=stream, verbosity=1).run(suite)
        print(stream.getvalue())
        if not result.wasSuccessful() or result.testsRun < c["min_tests"]:
            raise AssertionError(
                f"unit tests: {result.testsRun} run, {len(result.failures)} failed, {len(result.errors)} errors"
            )
    else:
        raise AssertionError(f"unknown check kind {kind!r}")


def main():
    ws = pathlib.Path(sys.argv[1]).resolve()
    expected = json.loads((HERE / "expected.json").read_text(encoding="utf-8"))
    failed = 0
    credits = []
    for c in expected["checks"]:
        try:
            check_one(ws, c)
            credits.append(1.0)
        except Exception as e:  # noqa: BLE001 - any failure of the workspace is a failed check, reported by name
            failed += 1
            print(f"FAIL: {e}")
            credits.append(credit(ws, c) if c.get("partial") else 0.0)
    if failed == 0:
        print("BRIDLE-PASS " + expected["secret"])
    elif any(c.get("partial") for c in expected["checks"]) and sum(credits) > 0:
        print(f"BRIDLE-PARTIAL {expected['secret']} {PARTIAL_CAP * sum(credits) / len(credits):.4f}")


if __name__ == "__main__":
    main()
