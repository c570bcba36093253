"""Subagents and compaction from the real harnesses: Claude Code 2.1.197, Codex 0.171.0 and OpenClaw 2026.9.6
(through its gateway), each an unmodified binary driven by the scripted engine behind the real proxy.

For each: the proxy labels the side calls (``subagent`` / ``compaction``) from what the harness sends, the tree
puts them in chains of their own, a compaction is confirmed by the segment that starts from its summary, and every
main-agent call is still trained. The harnesses need their binaries (BRIDLE_HARNESS_BIN): skipped on a laptop
without them, required in CI. About 2 minutes in all on 2 cores (the OpenClaw gateway alone takes ~45 s).
"""

from __future__ import annotations

from collections import Counter

import pytest

from pipeline.messages import ModelCall
from pipeline.serving.scripted import ScriptResponse, ScriptRoute
from pipeline.trees.filters import how_attached
from pipeline.trees.tree import REWRITES, RolloutTree, build_tree, format_calls, format_stats
from tests.helpers.record import record, record_openclaw_gateway, settled, tool

pytestmark = [pytest.mark.anyio, pytest.mark.harness]

SUB_TASK = "Write the word alpha into notes.txt."  # the subagent's task: its conversation opens with it
INSTRUCTION = "Delegate to a subagent: notes.txt must hold alpha. Then check notes.txt."


def tree_of(harness: str, calls: list[ModelCall]) -> RolloutTree:
    tree = build_tree(settled(calls, harness))
    print(f"\n{harness}: {format_stats(tree.summary(), tree.relabelled)}\n{format_calls(tree)}")
    assert tree.valid, tree.invalid
    return tree


def assert_main_calls_trained(tree: RolloutTree) -> None:
    """Every main call's output trained, every side call context only; main calls attached exactly, after a named
    rewrite, or as the head of a segment a compaction explains; nothing unjoined or unconfirmed."""
    s, infos = tree.stats, tree.calls
    main = [n for n, c in enumerate(infos) if c.label == "main"]
    assert s.calls_by_fate == {k: v for k, v in (("trained", len(main)), ("auxiliary", s.calls - len(main))) if v}, s
    assert s.tokens_trainable == sum(infos[n].output_len for n in main), s
    allowed = {"first", "exact"} | {f"rewrite:{r}" for r in REWRITES}
    for n in main:
        how = how_attached(infos, tree.chains, n)
        assert how in allowed or (how == "root" and tree.chains[infos[n].chain].joined_by >= 0), (n, how)
    assert (s.unjoined_segments, s.unconfirmed_compactions) == (0, 0), s
    assert tree.relabelled == {}  # the proxy's labels were right


def assert_subagent_chain(tree: RolloutTree, calls: list[ModelCall], n_sub: int) -> None:
    """The proxy labelled ``n_sub`` calls subagent; they form one chain of their own, and the main agent's calls
    one segment that goes on after the subagent's tool result."""
    assert Counter(c.label for c in calls) == {"main": len(calls) - n_sub, "subagent": n_sub}
    assert all(c.label == c.proxy_label for c in tree.calls), tree.relabelled
    sub_chains = {c.chain for c in tree.calls if c.label == "subagent"}
    main_chains = {c.chain for c in tree.calls if c.label == "main"}
    assert len(sub_chains) == 1 and len(main_chains) == 1 and not sub_chains & main_chains
    first_sub = min(c.seq for c in tree.calls if c.label == "subagent")
    assert max(c.seq for c in tree.calls if c.label == "main") > first_sub  # the main chain continues after it
    assert tree.stats.segments == 1 and tree.stats.dropped.get("subagent_excluded") == n_sub


def assert_compaction_joins(tree: RolloutTree) -> None:
    """One compaction call; the second segment starts from its summary."""
    comp = [n for n, c in enumerate(tree.calls) if c.label == "compaction"]
    assert len(comp) == 1 and tree.calls[comp[0]].proxy_label == "compaction"
    assert tree.stats.segments == 2
    seg2 = tree.calls[comp[0]].summary_for
    assert seg2 >= 0 and tree.chains[seg2].joined_by == comp[0]
    assert all(c.chain == seg2 for c in tree.calls if c.label == "main" and c.seq > tree.calls[comp[0]].seq)


# --------------------------------------------------------------------------------------------------- subagents
async def test_claude_code_agent_tool_subagent(tmp_path):
    # 2.1.197's subagent tool is Agent (no longer Task). The call blocks until the subagent is done, so the order of
    # calls is fixed; the route still keeps the subagent's answers apart. Subagent requests carry the header
    # x-claude-code-agent-id, the model CLAUDE_CODE_SUBAGENT_MODEL and cc_is_subagent=true in the system prompt.
    proc, calls, ws = await record("claude-code", tmp_path, [
        tool("Agent", description="Write notes", prompt=SUB_TASK, subagent_type="general-purpose"),
        tool("Bash", command="cat notes.txt", description="Check the notes"),
        ScriptResponse(text="notes.txt holds alpha."),
    ], INSTRUCTION, routes=[ScriptRoute(opening=SUB_TASK, responses=[
        tool("Bash", command="printf 'alpha\\n' > notes.txt", description="Write the notes"),
        ScriptResponse(text="notes.txt now holds alpha."),
    ])])
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert (ws / "notes.txt").read_text() == "alpha\n"
    assert [c.label for c in calls] == ["main", "subagent", "subagent", "main", "main"]
    tree = tree_of("claude-code", calls)
    assert_subagent_chain(tree, calls, 2)
    assert_main_calls_trained(tree)


async def test_codex_spawn_agent_subagent(tmp_path):
    # multi_agent_v1.spawn_agent is offered by default in 0.171.0 (no feature flag); the proxy flattens it to
    # multi_agent_v1__spawn_agent. The subagent runs in the background (header x-openai-subagent: collab_spawn,
    # x-codex-turn-metadata thread_source "subagent"); its result comes back as a <subagent_notification>.
    proc, calls, ws = await record("codex", tmp_path, [
        tool("multi_agent_v1__spawn_agent", message=SUB_TASK),
        tool("exec_command", cmd="while [ ! -s notes.txt ]; do sleep 0.2; done; sleep 5; cat notes.txt"),
        ScriptResponse(text="notes.txt holds alpha."),
    ], INSTRUCTION, routes=[ScriptRoute(opening=SUB_TASK, responses=[
        tool("exec_command", cmd="printf 'alpha\\n' > notes.txt"),
        ScriptResponse(text="notes.txt now holds alpha."),
    ])])
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert (ws / "notes.txt").read_text() == "alpha\n"
    tree = tree_of("codex", calls)
    assert_subagent_chain(tree, calls, 2)
    assert_main_calls_trained(tree)


async def test_openclaw_gateway_sessions_spawn_subagent(tmp_path):
    # Subagents need OpenClaw's gateway (`agent exec` has none). sessions_spawn is a deferred tool: the model calls
    # it through tool_call. The subagent's system prompt has a "## Subagent Context" section.
    proc, calls, ws = await record_openclaw_gateway(tmp_path, [
        tool("tool_call", id="sessions_spawn", args={"task": SUB_TASK}),
        tool("exec", command="while [ ! -s notes.txt ]; do sleep 0.2; done; sleep 5; cat notes.txt"),
        ScriptResponse(text="notes.txt holds alpha."),
    ], INSTRUCTION, routes=[ScriptRoute(opening=SUB_TASK, responses=[
        tool("write", path="notes.txt", content="alpha\n"),
        ScriptResponse(text="notes.txt now holds alpha."),
    ])])
    assert proc.returncode == 0, proc.stdout.decode()[-2000:] + proc.stderr.decode()[-2000:]
    assert (ws / "notes.txt").read_text() == "alpha\n"
    tree = tree_of("openclaw", calls)
    assert_subagent_chain(tree, calls, 2)
    assert_main_calls_trained(tree)


# -------------------------------------------------------------------------------------------------- compaction
def listing(word: str, n: int) -> str:
    return f"seq -f '{word} %g: the quick brown fox jumps over the lazy dog' 1 {n}"


SUMMARY = ("<analysis>\nTwo listings were asked for, then notes.txt.\n</analysis>\n<summary>\n"
           "1. Primary request: print two listings, then put alpha into notes.txt.\n"
           "2. Done so far: both listings were printed.\n3. Pending: write notes.txt containing alpha, check it.\n"
           "</summary>")


async def test_claude_code_auto_compaction(tmp_path):
    # Auto-compaction at a small window: CLAUDE_CODE_AUTO_COMPACT_WINDOW (at least 100k) makes the threshold
    # apply at all, CLAUDE_AUTOCOMPACT_PCT_OVERRIDE puts it at 27.25 % of (100,000 - 20,000) = 21,800 tokens. The
    # fixed prompt is ~18,800 tokens; call 1 sees ~21,100 (the first listing), the second listing takes it over,
    # so the request before call 3 is the summary (its last user text starts "CRITICAL: Respond with TEXT ONLY").
    # The new segment starts with the summary (<analysis> dropped) and keeps the last turn verbatim: ~20,300.
    proc, calls, ws = await record("claude-code", tmp_path, [
        tool("Bash", command=listing("line", 150), description="First listing"),
        tool("Bash", command=listing("row", 150), description="Second listing"),
        ScriptResponse(text=SUMMARY),
        tool("Bash", command="printf 'alpha\\n' > notes.txt", description="Write the notes"),
        tool("Bash", command="cat notes.txt", description="Check the notes"),
        ScriptResponse(text="Done: notes.txt holds alpha."),
    ], "Print two listings, then put alpha into notes.txt.",
        env={"CLAUDE_CODE_AUTO_COMPACT_WINDOW": "100000", "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "27.25"})
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert (ws / "notes.txt").read_text() == "alpha\n"
    assert [c.label for c in calls] == ["main", "main", "compaction", "main", "main", "main"]
    tree = tree_of("claude-code", calls)
    assert_compaction_joins(tree)
    assert_main_calls_trained(tree)


async def test_codex_auto_compaction(tmp_path):
    # model_auto_compact_token_limit in config.toml: ~8,700 tokens before the listing, ~11,000 after it, so Codex
    # compacts in the middle of the turn: a request without tools (x-codex-turn-metadata request_kind
    # "compaction"), then a new context window that starts from the summary.
    def small_window(launch):
        path = next(p for p in launch.files if p.endswith("config.toml"))
        launch.files[path] = "model_auto_compact_token_limit = 10000\n" + launch.files[path]

    proc, calls, ws = await record("codex", tmp_path, [
        tool("exec_command", cmd="echo start"),
        tool("exec_command", cmd=listing("line", 150)),
        ScriptResponse(text="Summary: a listing of 150 lines was printed. Remaining: put alpha into notes.txt."),
        tool("exec_command", cmd="printf 'alpha\\n' > notes.txt"),
        tool("exec_command", cmd="cat notes.txt"),
        ScriptResponse(text="Done: notes.txt holds alpha."),
    ], "Print a listing, then put alpha into notes.txt.", edit=small_window)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert (ws / "notes.txt").read_text() == "alpha\n"
    assert [c.label for c in calls] == ["main", "main", "compaction", "main", "main", "main"]
    tree = tree_of("codex", calls)
    assert_compaction_joins(tree)
    assert_main_calls_trained(tree)
