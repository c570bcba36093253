"""Trees built from real multi-turn recordings: Claude Code, Codex, Qwen Code, OpenClaw and the white-box harness
under C0, C1, C2.

Each test drives a real harness (unmodified binary, or harness_images/whitebox/harness.py as a local process) with
the scripted engine behind the real proxy, takes the ModelCalls the proxy emitted, builds the rollout's tree and
prints one line per recording (calls, segments, leaves, kept leaves, exact-prefix attach rate). Run with ``-s`` to
see the table. The attach rate must be 100 % wherever the harness itself did not rewrite its history (Claude Code,
Codex, white-box C0); C1 and C2 rewrite it on purpose and the tests check the structure the builder must find.

The npm harnesses need their binaries (BRIDLE_HARNESS_BIN or PATH, as in test_real_harnesses.py; Qwen Code and
OpenClaw the private Node 24 beside them): skipped on a laptop without them, required in CI. For each, a rollout of
at least three tool calls must train every main call, attached exactly or after a rewrite the builder names.
"""

from __future__ import annotations

import os
import subprocess
from itertools import pairwise
from pathlib import Path

import anyio
import numpy as np
import pytest

from pipeline.messages import ModelCall, RolloutFinished, RolloutRequest, SettledRollout, ids
from pipeline.rollout.harnesses import HARNESSES, LaunchContext, find_binary, launch_for
from pipeline.serving.scripted import Script, ScriptCall, ScriptResponse
from pipeline.trees.tree import REWRITES, RolloutTree, TreeOptions, build_tree, format_calls, format_stats
from tests.helpers.ci import require
from tests.helpers.harness_run import write_files
from tests.helpers.proxyutil import model_calls, renderer, running_proxy

pytestmark = [pytest.mark.anyio, pytest.mark.harness]

BIG = "".join(f"line {i:03d}: the quick brown fox jumps over the lazy dog\n" for i in range(40))  # 2,400 chars
# Above one BIG write, below everything that is left after a summary or a restart (system prompt + instruction +
# a few short turns stay under ~1,000 characters).
BUDGET = 1500


def call(name: str, **arguments) -> ScriptResponse:
    return ScriptResponse(tool_calls=[ScriptCall(name=name, arguments=arguments)])


async def record(harness: str, tmp_path: Path, responses: list[ScriptResponse], instruction: str,
                 extra_argv: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, list[ModelCall], Path]:
    """Run ``harness`` once against the proxy over a scripted engine; returns (process, model calls, workspace)."""
    binary = ""
    if not harness.startswith("whitebox"):
        found = find_binary(HARNESSES[harness].executable)
        require(found is not None, f"{harness} binary not installed (set BRIDLE_HARNESS_BIN)")
        binary = found or ""
    ws, home = tmp_path / "ws", tmp_path / "home"
    ws.mkdir()
    home.mkdir()
    rollout_id = harness.replace(":", "-")
    async with running_proxy(Script(rollouts={rollout_id: responses})) as (p, records, _token):
        token = p.open_rollout(rollout_id)
        ctx = LaunchContext(workspace=str(ws), home=str(home), base_url=p.base_url, token=token,
                            instruction=instruction, binary=binary)
        launch = launch_for(harness, ctx)
        write_files(launch)
        env = {"PATH": os.environ["PATH"], **launch.env}
        with anyio.fail_after(300):
            proc = await anyio.run_process([*launch.argv, *extra_argv], env=env, cwd=ws, stdin=subprocess.DEVNULL,
                                           check=False)
    assert proc.returncode == 0, proc.stdout.decode()[-2000:] + proc.stderr.decode()[-2000:]
    # Every request the harness made reached the engine and was recorded (no failed or foreign calls).
    assert {type(r).__name__ for r in records} <= {"CallStarted", "ModelCall"}, records
    calls = model_calls(records)
    assert calls and all(c.rollout_id == rollout_id for c in calls) and len(calls) == len(responses)
    return proc, calls, ws


ROWS: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def table():
    yield
    if ROWS:
        print("\n\nrecording            calls segments leaves kept exact-attach")
        print("\n".join(ROWS))


def tree_of(name: str, calls: list[ModelCall]) -> RolloutTree:
    rid = calls[0].rollout_id
    settled = SettledRollout(
        request=RolloutRequest(rollout_id=rid, group_id=rid, index=0, group_size=1, task_id="recording",
                               harness=name, token="-", policy_version=0),
        finished=RolloutFinished(rollout_id=rid, group_id=rid, status="ok", reward=1.0),
        calls=calls,
    )
    tree = build_tree(settled, TreeOptions())
    s = tree.stats
    print(f"\n{name}: {format_stats(tree.summary(), tree.relabelled)}\n{format_calls(tree)}")
    ROWS.append(f"{name:<20} {s.calls:>5} {s.segments:>8} {s.leaves:>6} {s.kept_leaves:>4} "
                f"{100 * s.exact_prefix_attach_rate:>11.1f}%")
    assert tree.valid, tree.invalid
    return tree


def rewrites(calls: list[ModelCall]) -> list[str]:
    """Where each call's input stops extending the previous call's history (input + output), decoded."""
    tok = renderer().tokenizer
    out = []
    for a, b in pairwise(calls):
        h = np.concatenate([ids(a.input_ids), ids(a.output_ids)])
        x = ids(b.input_ids)
        n = min(len(h), len(x))
        d = np.flatnonzero(h[:n] != x[:n])
        k = int(d[0]) if d.size else n
        if k < len(h):
            out.append(f"seq {b.seq} diverges from seq {a.seq} at token {k} of {len(h)}: "
                       f"{tok.decode(h[max(0, k - 20):k + 30].tolist())!r} -> "
                       f"{tok.decode(x[max(0, k - 20):k + 30].tolist())!r}")
    return out


def assert_linear(name: str, tree: RolloutTree, calls: list[ModelCall], n_calls: int) -> None:
    """A harness that only appends: one segment, one leaf, every call attached exactly where the last one ended."""
    where = rewrites(calls)
    assert not where, f"{name} rewrote its history:\n" + "\n".join(where)
    s = tree.stats
    assert (s.calls, s.segments, s.leaves, s.kept_leaves, s.depth) == (n_calls, 1, 1, 1, n_calls)
    assert s.exact_prefix_attach_rate == 1.0
    assert all(c.spliced_turns == c.seq and c.rendered_turns == 0 for c in calls), \
        [(c.seq, c.spliced_turns, c.rendered_turns) for c in calls]


def assert_every_main_call_trained(tree: RolloutTree) -> None:
    """Every call's output is trained, each attached at an exact prefix or after a named rewrite, one segment."""
    s = tree.stats
    assert s.calls_by_fate == {"trained": s.calls}, s
    assert set(s.attach) <= {"first", "exact"} | {f"rewrite:{r}" for r in REWRITES}, s.attach
    assert s.tokens_trainable == s.tokens_output and s.unjoined_segments == 0 and s.segments == 1, s


# ---------------------------------------------------------------------------------------------- real harnesses
async def test_claude_code_multi_turn_tree(tmp_path):
    ws = tmp_path / "ws"
    notes, big = ws / "notes.txt", ws / "big.txt"
    _, calls, _ = await record("claude-code", tmp_path, [
        call("Write", file_path=str(big), content=BIG),
        call("Bash", command=f"wc -l {big} && printf 'alpha\\n' > {notes}", description="Count lines, write notes"),
        call("Read", file_path=str(notes)),
        call("Write", file_path=str(notes), content="alpha\nbeta\n"),
        ScriptResponse(text="big.txt has 40 lines; notes.txt holds alpha and beta."),
    ], "Write big.txt, count its lines, then put alpha and beta into notes.txt.")
    assert big.read_text() == BIG and notes.read_text() == "alpha\nbeta\n"
    assert all(c.protocol == "anthropic" and c.label == "main" for c in calls)
    tree = tree_of("claude-code", calls)
    assert_linear("Claude Code", tree, calls, 5)
    assert_every_main_call_trained(tree)


async def test_codex_multi_turn_tree(tmp_path):
    _, calls, ws = await record("codex", tmp_path, [
        call("exec_command", cmd="printf 'alpha\\n' > notes.txt"),
        call("exec_command", cmd="cat notes.txt && ls"),
        call("exec_command", cmd="printf 'beta\\n' >> notes.txt && wc -l notes.txt"),
        ScriptResponse(text="notes.txt holds alpha and beta."),
    ], "Put alpha and beta, one per line, into notes.txt.")
    assert (ws / "notes.txt").read_text() == "alpha\nbeta\n"
    assert all(c.protocol == "responses" and c.label == "main" for c in calls)
    tree = tree_of("codex", calls)
    assert_linear("Codex", tree, calls, 4)
    assert_every_main_call_trained(tree)


async def test_qwen_code_multi_turn_tree(tmp_path):
    ws = tmp_path / "ws"
    notes = ws / "notes.txt"
    _, calls, _ = await record("qwen-code", tmp_path, [
        call("write_file", file_path=str(notes), content="alpha\n"),
        call("run_shell_command", command=f"wc -l {notes}", description="Count the lines"),
        call("write_file", file_path=str(notes), content="alpha\nbeta\n"),
        ScriptResponse(text="notes.txt holds alpha and beta."),
    ], "Put alpha and beta, one per line, into notes.txt.")
    assert notes.read_text() == "alpha\nbeta\n"
    assert all(c.protocol == "chat" and c.label == "main" for c in calls)
    tree = tree_of("qwen-code", calls)
    assert_linear("Qwen Code", tree, calls, 4)
    assert_every_main_call_trained(tree)


async def test_openclaw_multi_turn_tree(tmp_path):
    # OpenClaw ends every request with an "internal context" user turn that it drops from its history before the
    # next request: each call continues the previous one after that rewrite, on a path of its own. Before the
    # builder knew the rewrite, every call was a new root, relabelled compaction: 7 of 88 output tokens trained.
    _, calls, ws = await record("openclaw", tmp_path, [
        call("write", path="a.txt", content="alpha\n"),
        call("write", path="b.txt", content="beta\n"),
        call("write", path="c.txt", content="gamma\n"),
        ScriptResponse(text="All three files are written."),
    ], "Create a.txt, b.txt and c.txt containing alpha, beta and gamma.")
    assert [(ws / f).read_text() for f in ("a.txt", "b.txt", "c.txt")] == ["alpha\n", "beta\n", "gamma\n"]
    assert all(c.protocol == "chat" and c.label == "main" for c in calls)
    tree = tree_of("openclaw", calls)
    assert_every_main_call_trained(tree)
    assert tree.stats.attach == {"first": 1, "rewrite:dropped_trailing_turn": 3}
    assert tree.stats.kept_leaves == 4  # each call's own path: the history it saw, with its context turn


# -------------------------------------------------------------------------------------------- white-box harness
INSTRUCTION = "Write big.txt, then put alpha into notes.txt and check both."
SUMMARY = ScriptResponse(text="Summary: big.txt is written (40 lines); notes.txt holds alpha. Remaining: check both.")
STATE = ScriptResponse(text="State: big.txt is written (40 lines). Remaining: notes.txt with alpha, then check.")
STATE2 = ScriptResponse(text="State: big.txt, big2.txt and notes.txt are written. Remaining: read notes.txt back.")
FINAL = ScriptResponse(text="Done: big.txt and notes.txt are written and checked.")


async def test_whitebox_c0_tree(tmp_path):
    # C0 keeps the full history: every call appends to the previous one.
    _, calls, ws = await record("whitebox:S0T0O0C0W0", tmp_path, [
        call("write_file", path="big.txt", content=BIG),
        call("write_file", path="notes.txt", content="alpha\n"),
        call("read_file", path="notes.txt"),
        call("bash", command="wc -l big.txt notes.txt"),
        FINAL,
    ], INSTRUCTION, ("--summary-budget-chars", str(BUDGET), "--compaction-budget-chars", str(BUDGET)))
    assert (ws / "notes.txt").read_text() == "alpha\n"
    assert all(c.protocol == "chat" and c.label == "main" for c in calls)
    tree = tree_of("whitebox C0", calls)
    assert_linear("white-box C0", tree, calls, 5)


async def test_whitebox_c1_tree(tmp_path):
    # C1 (in-context summary). After turn 2 the history is over budget with two turn groups: the harness asks for a
    # summary (labelled compaction: it extends the history exactly), then REWRITES the history: system + instruction
    # + "Summary of the earlier work: ..." + the most recent turn verbatim, turn 1 (the BIG write) dropped. The next
    # main call therefore shares only system + instruction with the tree and no output token: it is the root of a
    # second main segment. Inside each segment every call attaches exactly, so the attach rate stays 100 %; the
    # rewrite shows up as the segment count, and the summary call is context, not trained.
    _, calls, ws = await record("whitebox:S0T0O0C1W0", tmp_path, [
        call("write_file", path="big.txt", content=BIG),
        call("write_file", path="notes.txt", content="alpha\n"),
        SUMMARY,
        call("read_file", path="notes.txt"),
        call("bash", command="wc -l big.txt notes.txt"),
        FINAL,
    ], INSTRUCTION, ("--summary-budget-chars", str(BUDGET)))
    assert (ws / "notes.txt").read_text() == "alpha\n"
    assert [c.label for c in calls] == ["main", "main", "compaction", "main", "main", "main"]
    tree = tree_of("whitebox C1", calls)
    s = tree.stats
    assert (s.calls, s.segments, s.kept_leaves) == (6, 2, 2)
    assert s.dropped.get("compaction_excluded") == 1
    by_seq = {c.seq: c for c in tree.calls}
    assert by_seq[2].label == "compaction" and not by_seq[2].included and by_seq[2].exact
    assert by_seq[3].chain != by_seq[1].chain and by_seq[3].chain == by_seq[5].chain  # the rewrite starts a segment
    first_after = ids(calls[3].input_ids)
    text = renderer().tokenizer.decode(first_after.tolist())
    assert "Summary of the earlier work:\n" + SUMMARY.text in text and BIG not in text
    assert [r.split(" at ")[0] for r in rewrites(calls)] == ["seq 3 diverges from seq 2"]
    # every call attaches exactly, but the new segment's root: explained by the compaction, so nothing unjoined
    assert s.attach == {"exact": 4, "first": 1, "root": 1} and s.unjoined_segments == 0
    assert s.exact_prefix_attach_rate == 4 / 5


async def test_whitebox_c2_tree(tmp_path):
    # C2 (externalized compaction). When the history is over budget the harness asks for the task state (labelled
    # compaction), saves it to .harness_state.md and RESTARTS: system + instruction + "State so far ...". Each restart
    # is a new main segment; the state calls are excluded from training; within segments calls attach exactly.
    _, calls, ws = await record("whitebox:S0T0O0C2W0", tmp_path, [
        call("write_file", path="big.txt", content=BIG),
        STATE,
        call("write_file", path="notes.txt", content="alpha\n"),
        call("write_file", path="big2.txt", content=BIG),
        STATE2,
        call("read_file", path="notes.txt"),
        FINAL,
    ], INSTRUCTION, ("--compaction-budget-chars", str(BUDGET)))
    assert (ws / "notes.txt").read_text() == "alpha\n"
    assert (ws / ".harness_state.md").read_text() == STATE2.text + "\n"
    assert [c.label for c in calls] == ["main", "compaction", "main", "main", "compaction", "main", "main"]
    tree = tree_of("whitebox C2", calls)
    s = tree.stats
    assert (s.calls, s.segments, s.kept_leaves) == (7, 3, 3)
    assert s.dropped.get("compaction_excluded") == 2
    chains = [c.chain for c in tree.calls]
    assert chains == [0, 0, 1, 1, 1, 2, 2]
    assert [c.label for c in tree.calls] == ["main", "compaction", "main", "main", "compaction", "main", "main"]
    assert [r.split(" at ")[0] for r in rewrites(calls)] == ["seq 2 diverges from seq 1", "seq 5 diverges from seq 4"]
    assert s.attach == {"exact": 4, "first": 1, "root": 2} and s.unjoined_segments == 0
    assert s.exact_prefix_attach_rate == 4 / 6
