"""The easiest family: create file F containing one word W (oracle: one ``write_file`` call).

Made for CPU-sized policies: the words come from a short list, so a tiny model can learn the mapping from the
instruction to the tool call's arguments within minutes, and RL has a measurable accuracy to improve.
"""

from __future__ import annotations

from pipeline.rollout.taskgen.common import act, build_task, rng_for
from pipeline.rollout.taskgen.create_file import _EXTS, _NAMES, _WORDS
from pipeline.rollout.tasks import TaskSpec

FAMILY = "create_word"
DIFFICULTY = "trivial"
DESCRIPTION = "create file F containing one word W from a short list (oracle: one write_file call)"


def generate(seed: int) -> TaskSpec:
    rng = rng_for(FAMILY, seed)
    name = rng.choice(_NAMES) + rng.choice(_EXTS)
    word = rng.choice(_WORDS)
    return build_task(
        family=FAMILY,
        seed=seed,
        difficulty=DIFFICULTY,
        instruction=f"Create file {name} containing: {word}",
        workspace={},
        checks=[{"kind": "text", "path": name, "text": word, "match": "strip", "partial": True}],
        actions=[act("write_file", path=name, content=word)],
    )
