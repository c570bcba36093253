"""Very easy: create one file with a short given text. The oracle is a single ``write_file`` call."""

from __future__ import annotations

from pipeline.rollout.taskgen.common import act, build_task, rng_for
from pipeline.rollout.tasks import TaskSpec

FAMILY = "create_file"
DIFFICULTY = "trivial"
DESCRIPTION = "create file F containing a short text X (oracle: one write_file call)"

_NAMES = ["a", "b", "x", "hi", "note", "out", "msg", "todo", "memo", "data", "log", "tag"]
_EXTS = [".txt", ".txt", ".txt", ".md", ""]
_WORDS = [
    "red",
    "blue",
    "green",
    "cat",
    "dog",
    "sun",
    "moon",
    "tree",
    "fox",
    "owl",
    "sky",
    "sea",
    "hello",
    "world",
    "ok",
    "yes",
    "zip",
    "map",
    "cup",
    "key",
    "box",
    "hat",
    "pen",
    "ant",
]


def generate(seed: int) -> TaskSpec:
    rng = rng_for(FAMILY, seed)
    name = rng.choice(_NAMES) + rng.choice(_EXTS)
    words = [rng.choice(_WORDS) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.5:
        words.append(str(rng.randint(0, 99)))
    text = " ".join(words)
    return build_task(
        family=FAMILY,
        seed=seed,
        difficulty=DIFFICULTY,
        instruction=f"Create file {name} containing: {text}",
        workspace={},
        # graded credit (share of words right) gives small policies a signal before they copy exactly
        checks=[{"kind": "text", "path": name, "text": text, "match": "strip", "partial": True}],
        actions=[act("write_file", path=name, content=text)],
    )
