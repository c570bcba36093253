"""The scripted engine: a rollout's list in call order; routes give side conversations (subagents) their own."""

from __future__ import annotations

import pytest

from pipeline.serving.engine import EngineSampling
from pipeline.serving.scripted import Script, ScriptedEngine, ScriptResponse, ScriptRoute
from pipeline.tokens.from_wire import from_chat
from tests.helpers.proxyutil import renderer

pytestmark = pytest.mark.anyio


def prompt(*messages: tuple[str, str]) -> list[int]:
    conv = from_chat({"messages": [{"role": r, "content": c} for r, c in messages]})
    return list(renderer().render_ids(conv))


async def test_a_route_gives_the_conversation_it_opens_a_list_of_its_own():
    main = [ScriptResponse(text=f"main {k}") for k in range(3)]
    sub = [ScriptResponse(text=f"sub {k}") for k in range(2)]
    script = Script(rollouts={"r": main}, routes=[ScriptRoute(opening="Write alpha", responses=sub)],
                    after_end=ScriptResponse(text="end"))
    eng = ScriptedEngine(renderer(), script)
    main_first = prompt(("system", "You are main."), ("user", "Use a subagent."))
    # the main agent's history names the subagent's task, but after its opening: still the main list
    main_later = prompt(("system", "You are main."), ("user", "Use a subagent."),
                        ("assistant", "Spawning: Write alpha into notes.txt."), ("user", "spawned"))
    sub_first = prompt(("system", "You are a helper."), ("user", "Write alpha into notes.txt."))
    order = [main_first, sub_first, main_later, main_later, sub_first, sub_first, main_later]
    tok = renderer().tokenizer
    got = []
    for x in order:
        res = await eng.generate(x, EngineSampling(), rid="r|c")
        got.append(tok.decode(res.output_ids).split("<|im_end|>")[0].strip())
    assert got == ["main 0", "sub 0", "main 1", "main 2", "sub 1", "end", "end"]


async def test_without_routes_every_call_of_a_rollout_takes_the_next_response():
    eng = ScriptedEngine(renderer(), Script(default=[ScriptResponse(text="a"), ScriptResponse(text="b")]))
    sub_first = prompt(("user", "Write alpha into notes.txt."))
    outs = [renderer().tokenizer.decode((await eng.generate(sub_first, EngineSampling(), rid=f"{r}|c")).output_ids)
            for r in ("x", "x", "y")]
    assert [o.split("<|im_end|>")[0].strip() for o in outs] == ["a", "b", "a"]
