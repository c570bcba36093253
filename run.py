#!/usr/bin/env python3
"""bridle command line. See README.md, or run ``python run.py --help``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.core.runtime import Resolver, Supervisor

import msgspec

# Every example is run by tests/e2e/test_cli.py::test_every_help_example_runs (RUN_DIR and LOG stand for a
# recorded run's folder and its events.msgpack).
EXAMPLES: list[tuple[str, str]] = [
    ("python run.py --experiment quickstart", "run configs/quickstart.toml"),
    ("python run.py --experiment configs/quickstart.toml --set learner.train.optimizer.lr=1e-4 --set experiment.seed=3",
     "a file by path, two fields overridden"),
    ("python run.py --experiment quickstart --validate", "check the experiment file and exit"),
    ("python run.py --resume RUN_DIR", "continue a run (also after kill -9) from its last checkpoint"),
    ("python run.py --serve --experiment serve", "engine + proxy only: record any harness by hand"),
    ("python run.py --replay LOG", "summary of a recorded run"),
    ("python run.py --replay LOG --json", "the same as one JSON object"),
    ("python run.py --replay LOG --calls", "every recorded model call, one line each"),
    ("python run.py --replay LOG --trees", "each rollout's prefix tree, how each call joined it, totals per harness"),
    ("python run.py --replay LOG --trees --json", "the same as one JSON object"),
    ("python run.py --replay LOG --stage trees", "rebuild the trees; compares their hashes"),
    ("python run.py --replay LOG --stage learner", "rerun the updates; compares the batch hashes"),
    ("python run.py --eval --experiment quickstart --checkpoint RUN_DIR",
     "evaluate a run's final policy on held-out tasks: pass@k, pass^k, behaviour (no learner)"),
    ("python run.py --eval --experiment quickstart", "evaluate [run].model (here the untrained base policy)"),
    ("python run.py --compare EVAL_A EVAL_B", "two evaluations side by side, differences paired over common pairs"),
    ("python run.py --replay LOG --eval", "every evaluation round of a recorded run, recomputed from its log"),
    ("python run.py --view RUN_DIR", "a static site to read its rollouts in a browser: RUN_DIR/view/index.html"),
    ("python run.py --build-images", "build the Docker sandbox images (needs a Docker engine)"),
]
EPILOG = (
    "examples (RUN_DIR: a run's folder, runs/<timestamp>-<name>; LOG: RUN_DIR/events.msgpack):\n"
    + "\n".join(f"  {cmd}\n      {what}" for cmd, what in EXAMPLES)
    + "\n\nexit codes: 0 done, 1 an actor crashed, 2 bad configuration or arguments (or a machine that lacks what the "
    "run needs), 3 the run ended but no rollout succeeded, 130 interrupted (Ctrl-C / SIGTERM)\n"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="run.py",
        description="bridle: train LLM agents with RL through real agent harnesses.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--experiment",
        metavar="NAME|PATH",
        help="experiment to run: NAME resolves to configs/NAME.toml, or give a path to a .toml file. "
        "The file is watched: edits to hot-reloadable fields apply to the running graph; edits to fixed fields "
        "are refused with a log line.",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override one config field (repeatable); VALUE is read as TOML (1e-6, true, \"text\", [1, 2]) and "
        "type-checked like the file",
    )
    p.add_argument(
        "--run-dir",
        metavar="DIR",
        help="where this run writes events.msgpack, config.toml and log.jsonl "
        "(default: <experiment.runs_dir>/<timestamp>-<name>/)",
    )
    p.add_argument(
        "--replay",
        metavar="LOG",
        help="read a recorded event log (runs/<run>/events.msgpack): print a summary (messages per type, "
        "rollouts, steps, time span), or with --stage re-feed recorded messages into part of the graph",
    )
    p.add_argument("--json", action="store_true",
                   help="with --replay (and --trees): print the summary (the tree report) as one JSON object")
    p.add_argument(
        "--stage",
        metavar="ACTOR[,ACTOR]",
        help="with --replay: actors to run again, fed with the messages they received in the recorded run "
        "(uses the recorded config; --set applies on top); their outputs go to a new run directory",
    )
    p.add_argument(
        "--calls", action="store_true", help="with --replay: list every recorded model call (one line each)"
    )
    p.add_argument(
        "--trees",
        action="store_true",
        help="with --replay: rebuild each rollout's prefix tree (any log: a --serve recording too) and print its "
        "statistics (how each call joined the tree, what was trained, tokens, rewrites, drops) and totals per "
        "harness; with --calls the tree call by call; with --json one JSON object",
    )
    p.add_argument(
        "--view",
        metavar="RUN_OR_LOG",
        help="write a static site of a run (or any event log: an evaluation, a --serve recording) that opens from "
        "disk: curves and a filterable table of rollouts, and a page per rollout (its tree, each call's request "
        "decoded, tool calls, output tokens coloured by whether they were trained); into --out or RUN/view",
    )
    p.add_argument("--out", metavar="DIR", help="with --view: where the site goes")
    p.add_argument(
        "--serve",
        action="store_true",
        help="with --experiment: start only the engine and the proxy, print one JSON line with openai_base_url, "
        "anthropic_base_url, token and run_dir, and record every call to the run's event log until Ctrl-C "
        "(point any harness at it by hand; --replay LOG --calls lists what it recorded)",
    )
    p.add_argument(
        "--build-images",
        action="store_true",
        help="build (or confirm up to date) the Docker sandbox images: a debootstrap base, the white-box, Claude "
        "Code, Codex, Qwen Code and OpenClaw images; idempotent; needs a running Docker engine and, for the npm harnesses, "
        "BRIDLE_HARNESS_BIN (see harness_images/ci_setup.sh)",
    )
    _evaluation_args(p)
    p.add_argument("--validate", action="store_true",
                   help="check the experiment file and what it needs from this machine (model, images, harnesses, "
                   "engine), print the resolved graph and exit; with --eval, the evaluation's graph")
    p.add_argument("--no-watch", action="store_true", help="do not watch the experiment file for changes")
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a run (also one killed with kill -9) from its last learner checkpoint, with its own "
        "config.toml (--set applies on top), appending to its event log",
    )
    return p.parse_args(argv)


def _evaluation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--eval",
        action="store_true",
        help="with --experiment: evaluate a policy with the experiment's evaluator ([eval]), proxy, sandboxes and "
        "verifiers and no learner; writes <run>/eval/report.json, report.md and a chart (docs/evaluation.md); with "
        "--replay LOG: recompute every evaluation round of that run from its log",
    )
    p.add_argument("--model", metavar="DIR", help="with --eval: the policy to evaluate (a Hugging Face folder)")
    p.add_argument("--checkpoint", metavar="RUN_DIR",
                   help="with --eval: evaluate that training run's final policy (its newest weights folder) and "
                   "never on its training or demonstration tasks")
    p.add_argument("--compare", nargs=2, metavar=("EVAL_A", "EVAL_B"),
                   help="print two evaluations' pass@k and mean reward and their difference A - B with a 95 %% "
                   "interval, paired over the (task, harness) pairs both measured")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # imported after parsing, so that --help answers without loading the library
    from actors import REGISTRY
    from pipeline.core import config as cfg
    from pipeline.core import logs
    from pipeline.core.eventlog import EventLogError
    from pipeline.core.runtime import ActorCrashed, Interrupted, make_resolver

    resolve = make_resolver(REGISTRY)
    # Until a run configures its own log file: warnings and errors to stderr, stdout stays machine-readable.
    logs.configure(None, level="warning")
    if args.build_images:
        from pipeline.rollout.images import main as build_images

        return build_images([])
    try:
        if args.compare:
            from pipeline.cli.evaluate import compare

            print(compare(Path(args.compare[0]), Path(args.compare[1])))
            return 0
        if args.view:
            from pipeline.cli.view import write_site

            try:
                print(f"wrote {write_site(Path(args.view), Path(args.out) if args.out else None)}")
            except FileNotFoundError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            return 0
        if args.replay:
            return replay(args, resolve)
        if args.resume:
            return resume(args, resolve)
        if not args.experiment:
            print("run.py: give --experiment NAME|PATH, --resume RUN_DIR or --replay LOG (see --help)",
                  file=sys.stderr)
            return 2
        return run(args, resolve)
    except (cfg.ConfigError, EventLogError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ActorCrashed as e:
        if isinstance(e.error, cfg.ConfigError):  # found when the actor started (e.g. the proxy's template check)
            print(f"error: {e.error}", file=sys.stderr)
            return 2
        logs.get_logger(actor="run").error("run stopped: actor crashed", actor=e.actor, error=str(e.error))
        return 1
    except Interrupted as e:
        logs.get_logger(actor="run").warning("run interrupted", reason=str(e))
        return 130
    except KeyboardInterrupt:
        return 130


def replay(args: argparse.Namespace, resolve: Resolver) -> int:
    """--replay LOG: print what the log holds (--trees, --calls, the summary), or rerun --stage from it."""
    from pipeline.cli import launch
    from pipeline.core.eventlog import summarize
    from pipeline.core.runtime import run_main

    log_path = Path(args.replay)
    if log_path.is_dir():
        log_path = log_path / "events.msgpack"
    if args.eval:
        from pipeline.cli import evaluate

        results = evaluate.replay_rounds(log_path)
        print(evaluate.replay_json(results) if args.json else evaluate.replay_text(results))
        return 0
    if args.trees:
        from pipeline.cli import tree_report

        rep, trees = tree_report.report(log_path)
        print(msgspec.json.encode(rep).decode() if args.json else tree_report.text(rep, trees, args.calls))
        return 0
    if args.calls:
        print("\n".join(launch.call_lines(log_path)))
        return 0
    if not args.stage:
        from pipeline.cli import harness_report

        s = summarize(log_path)
        per_harness = harness_report.report(log_path)
        if args.json:
            print(json.dumps({**s.as_dict(), "harnesses": msgspec.to_builtins(per_harness)}))
        else:
            print(launch.summary_text(s) + ("\n\n" + harness_report.text(per_harness) if per_harness else ""))
        return 0
    exp = launch.recorded_experiment(log_path, resolve, args.overrides)
    stage = launch.resolve_stage(exp, [x.strip() for x in args.stage.split(",") if x.strip()])
    rd = launch.prepare(exp, args.run_dir, suffix="-replay")
    run_main(launch.replay_stage, log_path, exp, resolve, stage, rd)
    print(json.dumps({"run_dir": str(rd.path), "events": str(rd.events),
                      **launch.compare_replay(log_path, rd.events)}))
    return 0


def resume(args: argparse.Namespace, resolve: Resolver) -> int:
    """--resume RUN_DIR: continue the run with its own config.toml (--set on top)."""
    from pipeline.cli import launch
    from pipeline.core import config as cfg
    from pipeline.core import logs
    from pipeline.core.runtime import run_main

    rd = launch.RunDir(Path(args.resume))
    exp = cfg.load_experiment(rd.config, resolve, args.overrides)
    from pipeline.cli.preflight import problems

    if found := problems(exp):
        raise cfg.ConfigError(f"--resume {rd.path}: this machine cannot run it yet:\n"
                              + "\n".join(f"  - {p}" for p in found))
    logs.configure(rd.log_file, level=exp.experiment.log_level)
    sup = run_main(lambda: launch.resume_experiment(exp, resolve, rd,
                                                    config_path=None if args.no_watch else rd.config))
    logs.get_logger(actor="run").info("run finished", run_dir=str(rd.path))
    return outcome(sup, rd.path)


def run(args: argparse.Namespace, resolve: Resolver) -> int:
    """--experiment: validate it, serve it (--serve) or run it."""
    from pipeline.cli import launch
    from pipeline.core import config as cfg
    from pipeline.core import logs
    from pipeline.core.runtime import run_main

    path = cfg.resolve_experiment_path(args.experiment)
    # --eval checks the graph it derives (no learner), not the training graph it comes from
    exp = cfg.load_experiment(path, resolve, args.overrides, check=not args.eval)
    if args.eval:
        from pipeline.cli.evaluate import eval_experiment

        exp, policy = eval_experiment(exp, resolve, model=args.model, checkpoint=args.checkpoint)
    elif args.model or args.checkpoint:
        print("run.py: --model and --checkpoint go with --eval", file=sys.stderr)
        return 2
    from pipeline.cli.preflight import problems

    if found := problems(exp):
        raise cfg.ConfigError(f"{path}: this machine cannot run it yet:\n" + "\n".join(f"  - {p}" for p in found))
    if args.validate:
        from pipeline.core.graphs import describe

        origin = f'preset "{exp.preset}"' if exp.preset else "custom graph"
        if exp.experiment.description:
            print(f"{exp.name}: {exp.experiment.description}")
        print(f"{path}: ok; {origin}, {len(exp.graph.actors)} actors (name, kind, where each output goes):")
        print("\n".join(describe(exp.graph.actors, exp.graph.parsed_edges(), exp.graph.stop_after)))
        return 0
    rd = launch.prepare(exp, args.run_dir)
    if args.serve:

        def announce(info: dict) -> None:
            print(json.dumps(info), flush=True)

        run_main(launch.serve, exp, resolve, rd, announce)
        return 0
    watch = None if args.no_watch or args.eval else path  # an evaluation's graph is derived: nothing to watch
    sup = run_main(lambda: launch.run_experiment(exp, resolve, rd, config_path=watch))
    logs.get_logger(actor="run").info("run finished", run_dir=str(rd.path))
    if args.eval:
        report = rd.path / "eval" / "report.md"
        print(report.read_text() if report.is_file() else f"no report was written ({report})")
        print(f"evaluated {policy}; reports in {rd.path / 'eval'}")
    return outcome(sup, rd.path)


NONE_SUCCEEDED = 3  # the run ended, but not one rollout ended ok: nothing it reports was measured


def outcome(sup: Supervisor, run_dir: Path) -> int:
    """0, or NONE_SUCCEEDED with the statuses and their first reasons on stderr (from the graph's monitor, which
    hears every rollout's end)."""
    from actors.monitor import Monitor

    for actor in sup.actors.values():
        if isinstance(actor, Monitor) and hasattr(actor, "state") and actor.state.outcomes.none_succeeded:
            print(f"run.py: {actor.state.outcomes.verdict()}\nrun.py: the run's log: {run_dir / 'log.jsonl'}",
                  file=sys.stderr)
            return NONE_SUCCEEDED
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except BrokenPipeError:
        # the reader of our output went away (`--replay LOG --calls | head`): what it wanted, it got
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    import threading

    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        # work abandoned on cancellation (a learner step, a model build): do not wait for it to finish
        from pipeline.core.runtime import exit_now

        exit_now(code)
    sys.exit(code)
