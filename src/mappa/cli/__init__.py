"""`mappa` command line: train | eval | rollout | coach score | serve | sandbox run | trace.

The CLI layer is the edge: every command and all console output live in `mappa.cli.<command>`; domain
modules return records and take an optional progress callback. This module only parses arguments and
imports each command's module lazily, so that `mappa sandbox run` does not pay for importing torch.
User errors (MappaError) print one line and exit 2; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import os
import sys

from mappa.errors import MappaError

# torch's OpenMP threads spin while they wait for work. On a CPU that another process also uses (a laptop,
# a shared CI box) the spinning threads starve each other: a batched generate on 2 cores took 102 s instead
# of 12 s next to one other busy process. Sleeping waiters cost ~25% when the cores are free (figures in
# docs/models.md). It must be set before torch is first imported, which the commands below do lazily.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _add_config_args(p: argparse.ArgumentParser, config_required: bool = True) -> None:
    if config_required:
        p.add_argument("config", help="YAML preset, e.g. configs/demo.yaml")
    else:
        p.add_argument("--config", default=None, help="YAML preset (default: built-in defaults)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override, e.g. train.steps=5",
    )


def _cmd_train(args: argparse.Namespace) -> int:
    from mappa.cli.train import train_command
    from mappa.config import load_config

    cfg = None if args.resume and args.config is None else load_config(args.config, args.overrides)
    return train_command(cfg, resume=args.resume, overrides=args.overrides)


def _cmd_eval(args: argparse.Namespace) -> int:
    from mappa.cli.evaluate import eval_command
    from mappa.config import load_config

    return eval_command(load_config(args.config, args.overrides), checkpoint=args.checkpoint, out=args.out)


def _cmd_rollout(args: argparse.Namespace) -> int:
    from mappa.cli.rollout import rollout_command
    from mappa.config import load_config

    return rollout_command(load_config(args.config, args.overrides), episodes=args.episodes, out=args.out)


def _cmd_coach_score(args: argparse.Namespace) -> int:
    from mappa.cli.coach import score_command
    from mappa.config import load_config

    overrides = list(args.overrides)
    if args.coach:
        overrides.append(f"coach.backend={args.coach}")
    if args.no_cache:
        overrides.append("coach.cache=false")
    return score_command(load_config(args.config, overrides), episodes=args.episodes, out=args.out)


def _cmd_serve(args: argparse.Namespace) -> int:
    from mappa.cli.serve import serve_command

    return serve_command(
        model=args.model,
        adapters=args.adapters,
        host=args.host,
        port=args.port,
        max_batch=args.max_batch,
        prefix_cache_mib=args.prefix_cache_mib,
        threads=args.threads,
    )


def _cmd_sandbox_run(args: argparse.Namespace) -> int:
    from mappa.cli.sandbox import sandbox_run_command

    return sandbox_run_command(
        args.file,
        timeout_s=args.timeout,
        memory_mb=args.memory_mb,
        workspace=args.workspace,
        pool=args.pool,
        confinement=args.confinement,
    )


def _cmd_trace(args: argparse.Namespace) -> int:
    from mappa.cli.trace import trace_command

    return trace_command(args.run_dir, episode=args.episode, step=args.step)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mappa", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a team of agents with per-action coach rewards")
    p.add_argument("config", nargs="?", default=None, help="YAML preset (omit with --resume)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("eval", help="evaluate agents (base or a checkpoint) with a rule-based answer check")
    _add_config_args(p)
    p.add_argument("--checkpoint", default=None, metavar="DIR", help="checkpoint directory (default: base model)")
    p.add_argument("--out", default=None, metavar="DIR", help="where to write eval JSONL")
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("rollout", help="run episodes of the configured workflow and write them as JSONL")
    _add_config_args(p)
    p.add_argument("--episodes", type=int, default=8, help="number of episodes")
    p.add_argument("--out", required=True, metavar="FILE.jsonl")
    p.set_defaults(func=_cmd_rollout)

    p = sub.add_parser("coach", help="coach utilities")
    csub = p.add_subparsers(dest="coach_command", required=True)
    c = csub.add_parser("score", help="score recorded episodes with a coach (replay; no generation)")
    c.add_argument("episodes", metavar="EPISODES.jsonl")
    _add_config_args(c, config_required=False)
    c.add_argument("--coach", default=None, help="backend: rubric | outcome | openai | local")
    c.add_argument("--no-cache", action="store_true", help="bypass the judgment cache")
    c.add_argument("--out", required=True, metavar="SCORED.jsonl")
    c.set_defaults(func=_cmd_coach_score)

    p = sub.add_parser("serve", help="OpenAI-compatible server for a base model and trained agent adapters")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name or path")
    p.add_argument("--adapters", default=None, metavar="DIR", help="checkpoint dir with one adapter per agent")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=16, help="most requests decoding in one batch at once")
    p.add_argument(
        "--threads", type=int, default=None, help="CPU threads for the model (default: torch's, one per core)"
    )
    p.add_argument(
        "--prefix-cache-mib",
        type=float,
        default=512,
        metavar="MIB",
        help="prompt KV kept so later prompts with the same opening prefill only the rest (0: off)",
    )
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("sandbox", help="the agents' code tool")
    ssub = p.add_subparsers(dest="sandbox_command", required=True)
    s = ssub.add_parser("run", help="run a Python file in the sandbox and print the ExecResult as JSON")
    s.add_argument("file")
    s.add_argument("--timeout", type=float, default=10.0, help="wall-clock limit in seconds")
    s.add_argument("--memory-mb", type=int, default=1024, help="resident-memory limit of the snippet's processes")
    s.add_argument("--workspace", default=None, help="directory the code may write (default: a fresh temp dir)")
    s.add_argument("--pool", action="store_true", help="run in a warm pre-imported worker")
    s.add_argument(
        "--confinement",
        choices=["auto", "bwrap", "fallback"],
        default="auto",
        help="auto: bubblewrap when it works, else the fallback; bwrap: required; fallback: forced",
    )
    s.set_defaults(func=_cmd_sandbox_run)

    p = sub.add_parser("trace", help="print episodes of a run agent by agent, with coach scores")
    p.add_argument("run_dir")
    p.add_argument("--episode", default=None, help="episode id (default: the latest failed episode)")
    p.add_argument("--step", type=int, default=None, help="only episodes of this step")
    p.set_defaults(func=_cmd_trace)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MappaError as e:
        print(f"mappa: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mappa: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
