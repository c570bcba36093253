"""The harness's command line (``harness.py`` calls :func:`main`).

Exit status: 0 the episode ended (the model answered without tool calls, or max turns), 1 the API failed,
2 the invocation was wrong (bad arguments, missing files, no API key).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from .client import ChatClient
from .components import HarnessConfig
from .context import Budgets
from .episode import Episode
from .errors import ApiError, UsageError
from .tools import Tools
from .transcript import Transcript

log = logging.getLogger("whitebox")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="bridle white-box harness (Chat Completions, streaming, tools)")
    p.add_argument("--config", required=True, help="configuration name, e.g. S0T1O2C1W0")
    p.add_argument("--workspace", required=True, type=Path, help="directory the task works in")
    p.add_argument("--instruction-file", required=True, type=Path, help="file holding the task instruction")
    p.add_argument("--base-url", required=True, help="http://host:port/v1 or unix:/path/to/socket")
    p.add_argument("--model", default="policy")
    p.add_argument("--max-turns", type=int, default=30, help="main model calls at most")
    p.add_argument("--transcript", required=True, type=Path, help="JSONL file the episode is recorded to")
    p.add_argument("--temperature", type=float)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--corpus", type=Path, help="local search/fetch corpus (default WORKSPACE/corpus)")
    p.add_argument("--summary-budget-chars", type=int, default=24000, help="C1: summarize above this")
    p.add_argument("--compaction-budget-chars", type=int, default=12000, help="C2: new segment above this")
    p.add_argument("--keep-recent-turns", type=int, default=1, help="C1: turns kept verbatim")
    p.add_argument("--verify-every", type=int, default=4, help="W2: progress check every N turns")
    p.add_argument("--state-file", default=".harness_state.md", help="C2: state file, relative to workspace")
    p.add_argument("--command-timeout", type=float, default=60.0, help="bash/python time limit (s)")
    p.add_argument("--max-output-chars", type=int, default=8000, help="tool output beyond this is cut")
    p.add_argument("--request-timeout", type=float, default=600.0, help="per model call (s)")
    p.add_argument("--api-retries", type=int, default=2)
    return p


def _episode(args: argparse.Namespace) -> Episode:
    """The episode the arguments describe; UsageError for anything wrong with them. Opens the transcript last,
    so a bad invocation leaves no file behind."""
    try:
        config = HarnessConfig.parse(args.config)
    except ValueError as e:
        raise UsageError(f"--config: {e}") from None
    api_key = os.environ.get("BRIDLE_API_KEY")
    if not api_key:
        raise UsageError("BRIDLE_API_KEY is not set; the proxy needs the rollout's token")
    if args.max_turns < 1 or args.verify_every < 1 or args.keep_recent_turns < 1:
        raise UsageError("--max-turns, --verify-every and --keep-recent-turns must be at least 1")
    workspace = args.workspace.resolve()
    if not workspace.is_dir():
        raise UsageError(f"--workspace {args.workspace} is not a directory")
    try:
        instruction = args.instruction_file.read_text(encoding="utf-8").strip()
    except OSError as e:
        raise UsageError(f"--instruction-file {args.instruction_file}: {e.strerror}") from None
    client = ChatClient(
        args.base_url,
        api_key,
        args.model,
        timeout=args.request_timeout,
        retries=args.api_retries,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
    )
    corpus = (args.corpus or workspace / "corpus").resolve()
    return Episode(
        config=config,
        client=client,
        tools=Tools(workspace, corpus, args.command_timeout, args.max_output_chars),
        transcript=Transcript(args.transcript),
        instruction=instruction,
        max_turns=args.max_turns,
        verify_every=args.verify_every,
        budgets=Budgets(
            summary_chars=args.summary_budget_chars,
            compaction_chars=args.compaction_budget_chars,
            keep_recent=args.keep_recent_turns,
            state_file=args.state_file,
        ),
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("whitebox %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    try:
        episode = _episode(args)
    except UsageError as e:
        log.error("%s", e)
        return 2
    try:
        reason = episode.run()
    except ApiError as e:
        episode.transcript.write(
            "end", reason="api_error", turns=episode.turn, segments=episode.segment + 1, error=str(e)
        )
        log.error("model API failed: %s", e)
        return 1
    finally:
        episode.transcript.close()
    log.info("episode ended (%s) after %d turns", reason, episode.turn)
    return 0
