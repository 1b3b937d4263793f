"""The argument parser (`build_parser`: every command, its options and help) and `main`, which runs the chosen
command and turns errors into one line and an exit status. Each command's module is imported lazily.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from mappa import __version__
from mappa.errors import MappaError
from mappa.plugins import UserCodeError, user_code_error

DESCRIPTION = "Finetune a team of LLM agents with per-action rewards from a coach, and see what the team did."
EPILOG = "`mappa COMMAND --help` shows a command's options. Errors are one line; --debug adds the whole traceback."
DEBUG_HELP = "on an error, print the whole traceback too (also: MAPPA_DEBUG=1)"
DEBUG_HINT = " (--debug or MAPPA_DEBUG=1: the whole traceback)"

# torch's OpenMP threads spin while they wait for work. On a CPU that another process also uses (a laptop,
# a shared CI box) the spinning threads starve each other: a batched generate on 2 cores took 102 s instead
# of 12 s next to one other busy process. Sleeping waiters cost ~25% when the cores are free (figures in
# docs/models.md). It must be set before torch is first imported, which the commands below do lazily.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _add_set(p: argparse.ArgumentParser, metavar: str = "KEY=VALUE", example: str = "train.steps=5") -> None:
    help_text = f"override a config field, e.g. {example} (repeatable; `mappa config show` lists every field)"
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar=metavar, help=help_text)


def _add_config_args(p: argparse.ArgumentParser, config_required: bool = True) -> None:
    if config_required:
        p.add_argument("config", help="YAML preset, e.g. configs/demo.yaml")
    else:
        p.add_argument("--config", default=None, help="YAML preset (default: built-in defaults)")
    _add_set(p)


def _cmd_train(args: argparse.Namespace) -> int:
    from mappa.cli.train import train_command
    from mappa.config import load_config

    # No CONFIG: a resume reads the run's own; --set alone trains the built-in defaults; nothing at all is an error.
    bare = args.config is None and (args.resume or not args.overrides)
    cfg = None if bare else load_config(args.config, args.overrides)
    return train_command(cfg, resume=args.resume, overrides=args.overrides, ray=args.ray)


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
        _check_coach_arg(args.coach)
        overrides.append(f"coach.backend={args.coach}")
    if args.no_cache:
        overrides.append("coach.cache=false")
    return score_command(load_config(args.config, overrides), episodes=args.episodes, out=args.out)


def _check_coach_arg(name: str) -> None:
    """`--coach NAME` checked by itself, so that its errors name `--coach` (not the config's overrides); a plug-in's
    relative file resolves against the working directory, as with --set."""
    from mappa.config import BUILTIN_COACHES
    from mappa.plugins import anchor, check_coach, is_import_path, load_object

    key = f"--coach {name}"
    if name in BUILTIN_COACHES:
        return
    if not is_import_path(name):
        raise MappaError(f"{key}: not one of {', '.join(BUILTIN_COACHES)}, nor a plug-in FILE.py:NAME or module:NAME")
    check_coach(load_object(anchor(name, Path.cwd()), key), key)


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
        api_key=args.api_key,
        adapter_roots=args.adapter_roots,
        max_loaded_adapters=args.max_loaded_adapters,
        max_model_len=args.max_model_len,
        max_body_mib=args.max_body_mib,
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


def _cmd_probe(args: argparse.Namespace) -> int:
    from mappa.cli.probe import probe_command

    return probe_command(
        args.run_dir, force=args.force, prompts=args.prompts, gsm8k=args.gsm8k, gsm8k_tokens=args.gsm8k_tokens
    )


def _cmd_export(args: argparse.Namespace) -> int:
    from mappa.cli.export import export_command

    return export_command(
        args.run_dir, args.out, checkpoint=args.checkpoint, merge=args.merge, push_to_hub=args.push_to_hub
    )


def _add_export_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="a run's agents as adapters or merged models, a model card and a vLLM line")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--checkpoint", default=None, metavar="NAME|PATH", help="default: the run's latest checkpoint")
    p.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) directory")
    p.add_argument("--merge", action="store_true", help="each agent's adapter merged into a full model")
    p.add_argument("--push-to-hub", default=None, metavar="REPO", help="upload DIR to this Hub model repository")
    p.set_defaults(func=_cmd_export)


def _add_probe_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("probe", help="specialisation and forgetting per checkpoint (KL from the base, NLLs)")
    p.add_argument("run_dir")
    p.add_argument("--force", action="store_true", help="measure checkpoints already in probe.jsonl again")
    p.add_argument("--prompts", type=int, default=16, help="role prompts per agent (from eval/start.jsonl)")
    p.add_argument("--gsm8k", type=int, default=0, metavar="N", help="also N GSM8K questions answered alone")
    p.add_argument("--gsm8k-tokens", type=int, default=256, help="token cap of a GSM8K answer")
    p.set_defaults(func=_cmd_probe)


def _cmd_report(args: argparse.Namespace) -> int:
    from mappa.cli.report import report_command

    return report_command(args.run_dirs, out=args.out, overrides=args.overrides)


def _cmd_blame(args: argparse.Namespace) -> int:
    from mappa.cli.blame import blame_command

    return blame_command(args.run_dir, step=args.step, latest=args.latest)


def _cmd_compare(args: argparse.Namespace) -> int:
    from mappa.cli.compare import compare_command

    return compare_command(args.run_dirs, json_out=args.json)


def _cmd_config_show(args: argparse.Namespace) -> int:
    from mappa.cli.config_show import config_show_command

    return config_show_command(args.config, args.overrides, schema=args.schema)


def _add_config_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="the resolved config with every field's help, and its JSON schema")
    csub = p.add_subparsers(dest="config_command", required=True, metavar="COMMAND", title="commands")
    c = csub.add_parser("show", help="print the config (preset or defaults, then --set) as commented YAML")
    c.add_argument("config", nargs="?", default=None, help="YAML preset (default: built-in defaults)")
    _add_set(c)
    c.add_argument("--schema", default=None, metavar="PATH", help="also write the config's JSON schema to PATH")
    c.set_defaults(func=_cmd_config_show)


def _cmd_dsbench(args: argparse.Namespace) -> int:
    from mappa.cli.dsbench import build_command, list_command

    if args.dsbench_command == "build":
        return build_command(args.out, seed=args.seed, only=args.only)
    return list_command(args.dir)


def _add_analysis_commands(sub: argparse._SubParsersAction) -> None:
    """report | blame | compare: read run directories, rerun nothing (docs/analysis.md)."""
    p = sub.add_parser("report", help="an HTML report of one or more runs, rebuilt from their files")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", default=None, metavar="FILE.html", help="default: RUN_DIR/report.html")
    _add_set(p, "analysis.KEY=VALUE", "analysis.bias_gap=1.5")
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser("blame", help="failed episodes by the agent the coach scored lowest, and the kind of failure")
    p.add_argument("run_dir")
    p.add_argument("--step", type=int, default=None, help="only episodes of this step")
    p.add_argument("--latest", type=int, default=10, help="how many of the latest failed episodes to show")
    p.set_defaults(func=_cmd_blame)

    p = sub.add_parser("compare", help="final metrics of several runs with 95%% intervals and their differences")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the table as JSON")
    p.set_defaults(func=_cmd_compare)


def _add_dsbench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dsbench", help="the offline mini-DSBench: Kaggle-style tabular tasks (docs/dsbench.md)")
    dsub = p.add_subparsers(dest="dsbench_command", required=True, metavar="COMMAND", title="commands")
    d = dsub.add_parser("build", help="build the benchmark into a directory (byte-identical for one seed)")
    d.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) directory for the benchmark")
    d.add_argument("--seed", type=int, default=42, help="split and sampling seed")
    d.add_argument("--only", nargs="+", default=[], metavar="ID", help="build only these task ids")
    d.set_defaults(func=_cmd_dsbench)
    d = dsub.add_parser("list", help="the catalogue, or with --dir a built benchmark's tasks and scores")
    d.add_argument("--dir", default=None, metavar="DIR", help="a built benchmark (mappa dsbench build --out DIR)")
    d.set_defaults(func=_cmd_dsbench)


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server for a base model and trained agent adapters")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name or path")
    p.add_argument("--adapters", default=None, metavar="DIR", help="checkpoint dir with one adapter per agent")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
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
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require Authorization: Bearer KEY on every path but /health (default: $MAPPA_API_KEY; "
        "without a key the server listens on loopback only)",
    )
    p.add_argument(
        "--adapter-root",
        dest="adapter_roots",
        action="append",
        default=[],
        metavar="DIR",
        help="load runtime adapters only from under DIR (repeatable; default: ./runs and the --adapters run)",
    )
    p.add_argument(
        "--max-loaded-adapters", type=int, default=16, help="adapters loaded at once (least recently used unloaded)"
    )
    p.add_argument(
        "--max-model-len", type=int, default=None, help="prompt + reply tokens (default: the model's context)"
    )
    p.add_argument("--max-body-mib", type=float, default=8.0, metavar="MIB", help="largest request body (413 above)")
    p.set_defaults(func=_cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mappa", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"mappa {__version__}")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")

    p = sub.add_parser("train", help="train a team of agents with per-action coach rewards")
    p.add_argument("config", nargs="?", default=None, help="YAML preset (omit with --resume)")
    _add_set(p)
    p.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue a run from its last checkpoint")
    ray_help = "rollout workers and a trainer per agent on Ray: a new local cluster, the running one, or its address"
    p.add_argument("--ray", default=None, metavar="local|auto|ADDRESS", help=ray_help + " (docs/scale.md)")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("eval", help="evaluate agents (base or a checkpoint) with a rule-based answer check")
    _add_config_args(p)
    p.add_argument("--checkpoint", default=None, metavar="DIR", help="checkpoint directory (default: base model)")
    p.add_argument("--out", default=None, metavar="DIR", help="where to write eval JSONL")
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("rollout", help="run episodes of the configured workflow and write them as JSONL")
    _add_config_args(p)
    p.add_argument("--episodes", type=int, default=8, help="number of episodes")
    p.add_argument("--out", required=True, metavar="FILE.jsonl", help="where to write the episodes, one a line")
    p.set_defaults(func=_cmd_rollout)

    p = sub.add_parser("coach", help="score recorded episodes again, with any coach (replay: no generation)")
    csub = p.add_subparsers(dest="coach_command", required=True, metavar="COMMAND", title="commands")
    c = csub.add_parser("score", help="score recorded episodes with a coach (replay; no generation)")
    c.add_argument("episodes", metavar="EPISODES.jsonl")
    _add_config_args(c, config_required=False)
    c.add_argument(
        "--coach",
        default=None,
        metavar="NAME",
        help="rubric | outcome | openai | local, or a plug-in FILE.py:NAME or module:NAME (a reward function, a "
        "coach class or instance, or a factory; docs/your-team.md); default: the config's coach.backend",
    )
    c.add_argument("--no-cache", action="store_true", help="bypass the judgment cache")
    c.add_argument("--out", required=True, metavar="SCORED.jsonl", help="the episodes with every action scored again")
    c.set_defaults(func=_cmd_coach_score)

    _add_serve_parser(sub)

    p = sub.add_parser("sandbox", help="the agents' code tool: run a Python file in the sandbox")
    ssub = p.add_subparsers(dest="sandbox_command", required=True, metavar="COMMAND", title="commands")
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

    _add_export_command(sub)
    _add_probe_command(sub)
    _add_analysis_commands(sub)
    _add_dsbench_parser(sub)
    _add_config_parser(sub)
    _add_debug(parser)
    return parser


def _add_debug(parser: argparse.ArgumentParser) -> None:
    """`--debug` after any command too (`mappa train CONFIG --debug`); SUPPRESS keeps the top-level value when a
    command does not give it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
                _add_debug(command)


def _error(e: MappaError, debug: bool) -> int:
    """One line for an error the user can fix; with `debug`, the whole traceback above it (for an error in the
    user's code: the traceback of the exception their code raised)."""
    if debug:
        traceback.print_exception(e.original if isinstance(e, UserCodeError) else e)
    if isinstance(e, UserCodeError):
        print(f"mappa: {e}{'' if debug else DEBUG_HINT}", file=sys.stderr)
    else:
        print(f"mappa: error: {e}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("MAPPA_DEBUG", "") not in ("", "0")
    try:
        return int(args.func(args) or 0)
    except MappaError as e:
        return _error(e, debug)
    except KeyboardInterrupt:
        print("mappa: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        located = user_code_error(e)
        if located is None:  # mappa's own fault, or a library's under it: the traceback is the report
            raise
        return _error(located, debug)
