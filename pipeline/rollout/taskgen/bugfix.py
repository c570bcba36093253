"""Make the unit tests pass: a small Python module with a one-line bug and a unittest file that exposes it.

Expected values come from running the correct code at generation time; the generator makes sure the buggy code
fails at least one visible test. The hidden check (a ``calls`` check of the checker, see ``check_template.py``)
calls the module's functions on the visible tests' inputs plus as many held-out ones, in a child process, and
compares the returned values itself: editing the visible tests does not help, nor does a module that looks its
answers up in them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

from pipeline.rollout.taskgen.common import act, build_task, rng_for
from pipeline.rollout.tasks import TaskSpec

FAMILY = "bugfix"
DIFFICULTY = "medium"
DESCRIPTION = "fix a one-line bug in a Python module so that its unittest file passes"

Inputs = Callable[[random.Random], list[tuple[Any, ...]]]


class _Fn:
    def __init__(self, name: str, src: str, good: str, bad: str, inputs: Inputs, approx: bool = False):
        self.name, self.src, self.good, self.bad, self.inputs, self.approx = (
            name,
            src,
            good,
            bad,
            inputs,
            approx,
        )


def _ints(rng: random.Random, k: int, lo: int, hi: int) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(k)]


_WORDS = ["unit", "queue", "house", "mouse", "sun", "blue", "tree", "sky", "rhythm", "output", "audio", "fun"]

_FNS = [
    _Fn(
        "clamp",
        'def clamp(x, lo, hi):\n    """Limit x to the range [lo, hi]."""\n    return max(lo, min(x, hi))\n',
        "return max(lo, min(x, hi))",
        "return max(lo, min(x, lo))",
        lambda r: [(r.randint(-50, 150), 0, r.randint(10, 100)) for _ in range(5)],
    ),
    _Fn(
        "sum_to",
        'def sum_to(n):\n    """Sum of the integers 1..n (inclusive)."""\n    return sum(range(1, n + 1))\n',
        "return sum(range(1, n + 1))",
        "return sum(range(1, n))",
        lambda r: [(n,) for n in _ints(r, 4, 1, 60)],
    ),
    _Fn(
        "count_vowels",
        'def count_vowels(s):\n    """Number of vowels (a, e, i, o, u) in s, ignoring case."""\n'
        '    return sum(1 for ch in s.lower() if ch in "aeiou")\n',
        'if ch in "aeiou")',
        'if ch in "aeio")',
        lambda r: [(" ".join(r.sample(_WORDS, 3)).capitalize(),) for _ in range(4)],
    ),
    _Fn(
        "average",
        'def average(xs):\n    """Arithmetic mean of a non-empty list."""\n    return sum(xs) / len(xs)\n',
        "return sum(xs) / len(xs)",
        "return sum(xs) / (len(xs) + 1)",
        lambda r: [(_ints(r, r.randint(1, 6), -20, 80),) for _ in range(4)],
        approx=True,
    ),
    _Fn(
        "reverse_words",
        'def reverse_words(s):\n    """The words of s in reverse order, separated by single spaces."""\n'
        '    return " ".join(reversed(s.split()))\n',
        'return " ".join(reversed(s.split()))',
        'return " ".join(s.split())',
        lambda r: [(" ".join(r.sample(_WORDS, r.randint(2, 5))),) for _ in range(4)],
    ),
    _Fn(
        "index_of_max",
        'def index_of_max(xs):\n    """Index of the first largest element of a non-empty list."""\n    best = 0\n'
        "    for i, x in enumerate(xs):\n        if x > xs[best]:\n            best = i\n    return best\n",
        "if x > xs[best]:",
        "if x < xs[best]:",
        lambda r: [(r.sample(range(100), r.randint(3, 7)),) for _ in range(4)],
    ),
    _Fn(
        "to_fahrenheit",
        'def to_fahrenheit(c):\n    """Degrees Celsius to degrees Fahrenheit."""\n    return c * 9 / 5 + 32\n',
        "return c * 9 / 5 + 32",
        "return c * 9 / 5 - 32",
        lambda r: [(c,) for c in _ints(r, 4, -40, 100)],
        approx=True,
    ),
    _Fn(
        "is_leap",
        'def is_leap(year):\n    """True for leap years of the Gregorian calendar."""\n'
        "    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n",
        "(year % 100 != 0 or year % 400 == 0)",
        "(year % 100 != 0)",
        lambda r: (
            [(r.choice([1600, 2000, 2400]),), (r.choice([1900, 2100, 2200]),)]
            + [(y,) for y in _ints(r, 3, 1901, 2099)]
        ),
    ),
    _Fn(
        "discount",
        'def discount(price, percent):\n    """Price after taking off the given percentage."""\n'
        "    return price * (1 - percent / 100)\n",
        "(1 - percent / 100)",
        "(1 - percent / 10)",
        lambda r: [(r.randint(10, 500), r.choice([5, 10, 15, 20, 25, 50])) for _ in range(4)],
        approx=True,
    ),
    _Fn(
        "chunks",
        'def chunks(xs, size):\n    """Split xs into consecutive lists of length size (the last may be shorter)."""\n'
        "    return [xs[i:i + size] for i in range(0, len(xs), size)]\n",
        "range(0, len(xs), size)",
        "range(0, len(xs) - size, size)",
        lambda r: [(list(range(r.randint(4, 11))), r.randint(2, 3)) for _ in range(4)],
    ),
]

_MODULES = ["mathutils", "helpers", "toolkit", "calc", "utils", "numbers_lib", "textkit", "funcs", "core"]


def _call(src: str, name: str, args: tuple[Any, ...]) -> Any:
    ns: dict[str, Any] = {}
    exec(src, ns)  # noqa: S102 - our own template code, to compute the expected values
    return ns[name](*args)


def _assertion(fn: _Fn, args: tuple[Any, ...], want: Any) -> str:
    call = f"{fn.name}({', '.join(repr(a) for a in args)})"
    if fn.approx:
        return f"self.assertAlmostEqual({call}, {want!r}, places=6)"
    return f"self.assertEqual({call}, {want!r})"


def _case(fn: _Fn, args: tuple[Any, ...], want: Any) -> dict[str, Any]:
    """One call the checker makes, as JSON: tuples become lists on both sides, as they do in the child's report."""
    return json.loads(json.dumps({"fn": fn.name, "args": list(args), "want": want, "approx": fn.approx}))


def generate(seed: int) -> TaskSpec:
    rng = rng_for(FAMILY, seed)
    target, *decoys = rng.sample(_FNS, rng.randint(2, 3))
    module = rng.choice(_MODULES)
    fns = [target, *decoys]
    rng.shuffle(fns)
    good_src = "\n\n".join(f.src for f in fns)
    bad_src = good_src.replace(target.good, target.bad)
    assert good_src.count(target.good) == 1 and bad_src.count(target.bad) == 1

    for _ in range(50):  # draw inputs until at least one exposes the bug (almost always the first draw)
        tests: list[str] = []
        cases: list[dict[str, Any]] = []
        buggy_fails = False
        for fn in sorted(fns, key=lambda f: f.name):
            for i, args in enumerate(fn.inputs(rng)):
                want = _call(good_src, fn.name, args)
                got_bad = _call(bad_src, fn.name, args)
                buggy_fails |= (abs(got_bad - want) > 1e-6) if fn.approx else (got_bad != want)
                tests.append(f"    def test_{fn.name}_{i}(self):\n        {_assertion(fn, args, want)}\n")
                cases.append(_case(fn, args, want))
        if buggy_fails:
            break
    else:
        raise AssertionError(f"bugfix seed {seed}: no generated inputs expose the {target.name} bug")
    held_out = [_case(fn, args, _call(good_src, fn.name, args)) for fn in sorted(fns, key=lambda f: f.name)
                for args in fn.inputs(rng)]

    names = ", ".join(sorted(f.name for f in fns))
    test_file = (
        f"import unittest\n\nfrom {module} import {names}\n\n\nclass Test{module.title().replace('_', '')}"
        f"(unittest.TestCase):\n" + "\n".join(tests) + '\n\nif __name__ == "__main__":\n    unittest.main()\n'
    )
    line_good = next(ln for ln in good_src.splitlines() if target.good in ln)
    line_bad = line_good.replace(target.good, target.bad)
    return build_task(
        family=FAMILY,
        seed=seed,
        difficulty=DIFFICULTY,
        instruction=(
            f"The unit tests in test_{module}.py fail. Fix the bug in {module}.py so that "
            f"`python3 -m unittest test_{module}` passes. Do not change the tests."
        ),
        workspace={f"{module}.py": bad_src, f"test_{module}.py": test_file},
        checks=[{"kind": "calls", "module": module, "cases": cases + held_out, "timeout_s": 30}],
        actions=[
            act("read_file", path=f"test_{module}.py"),
            act("edit_file", path=f"{module}.py", old=line_bad, new=line_good),
            act("bash", command=f"python3 -m unittest test_{module}"),
        ],
        category="programming",
    )
