"""`mappa export`: a run's trained agents as files other tools load, a model card, and the line that serves them.

Layout of an export directory:
  <agent>/    lora: the agent's PEFT adapter (adapter_config.json, adapter_model.safetensors); with `merge`, or
              for `model.agent_weights: full`, a whole transformers model (save_pretrained) with its tokenizer
  shared/     shared: the one adapter every agent uses (merged: the one model)
  base/       only when the run's base had no name to load it by (an in-memory model): its weights
  README.md   model card: the run's settings (config.yaml), the checkpoint's evaluation, the serve line

Adapters name their base as the run's `model.name` gave it (`mappa.policy.models.public_name`: the embedded SmolLM2 as
its hub id HuggingFaceTB/SmolLM2-135M-Instruct), so `vllm serve <base> --enable-lora --lora-modules ...` and peft's
AutoPeftModelForCausalLM find it. The embedded weights are that model's Q4_1 GGUF, dequantized: on the hub
original an adapter answers close to, not exactly as, the trained agent; a merged export holds the exact weights.

Merging loads the base once per adapter as the run loaded it (model.init_kwargs, but no quantization_config: the
merged weights are plain, in model.dtype), applies the adapter with peft and `merge_and_unload`. An export is
written into a hidden sibling of its directory and renamed into place: a failed export leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mappa.config import Config
from mappa.errors import MappaError
from mappa.policy.models import load_base_model, public_name
from mappa.policy.storage import read_manifest
from mappa.training.checkpoint import latest_checkpoint
from mappa.training.evaluate import eval_gain, policy_dir
from mappa.training.tracking import read_metrics, run_config

VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM's --max-lora-rank accepts
_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_PLACEMENT_KEYS = ("quantization_config", "device_map")  # left out when merging: merged weights are plain


@dataclass(frozen=True)
class Exported:
    """What `export_run` wrote."""

    out: Path
    checkpoint: Path  # the checkpoint directory exported
    step: int | None  # its training step (state.json), None when it has no state.json
    agent_weights: str  # lora | shared | full
    merged: bool  # the directories hold whole models (merge, or full weights), not adapters
    dirs: dict[str, str]  # agent -> its directory's name under `out` (shared: every agent's is "shared")
    serve_lines: tuple[str, ...]  # the vLLM command lines, with `out`'s absolute path


def find_checkpoint(run_dir: Path, checkpoint: str | None) -> Path:
    """`checkpoint` as a name under RUN/checkpoints or a path; None: the run's latest complete checkpoint."""
    if checkpoint is None:
        found = latest_checkpoint(run_dir)
        if found is None:
            raise MappaError(f"{run_dir}: no complete checkpoint under {run_dir / 'checkpoints'}")
        return found
    for candidate in (run_dir / "checkpoints" / checkpoint, Path(checkpoint).expanduser()):
        if candidate.is_dir():
            return candidate
    raise MappaError(f"--checkpoint {checkpoint}: neither {run_dir / 'checkpoints' / checkpoint} nor a directory")


def export_run(
    run_dir: str | Path,
    out: str | Path,
    *,
    checkpoint: str | None = None,
    merge: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Exported:
    """Export every agent of `run_dir`'s checkpoint (default: the latest) into `out` (see the module docstring);
    `out` must not exist or be empty. `progress(text)` names each step as it starts."""
    run, out = Path(run_dir), Path(out)
    cfg = run_config(run)
    ckpt = find_checkpoint(run, checkpoint)
    weights = policy_dir(ckpt)
    manifest = read_manifest(weights)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MappaError(f"--out {out}: exists and is not empty")
    step = _checkpoint_step(ckpt)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        dirs, base = _write_weights(cfg, weights, manifest, tmp, merge, progress or (lambda text: None))
        merged = merge or manifest["agent_weights"] == "full"
        serve = _serve_options(manifest, cfg, dirs, base, merged)
        card = model_card(cfg, manifest, ckpt, step, dirs, merged, serve_lines(root=".", **serve), run)
        (tmp / "README.md").write_text(card, encoding="utf-8")
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except OSError as e:
        raise MappaError(f"--out {out}: cannot write the export ({e.strerror or e})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    lines = serve_lines(root=str(out.resolve()), **serve)
    return Exported(out, ckpt, step, manifest["agent_weights"], merged, dirs, tuple(lines))


def _checkpoint_step(ckpt: Path) -> int | None:
    try:
        step = json.loads((ckpt / "state.json").read_text(encoding="utf-8")).get("step")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def _write_weights(
    cfg: Config, weights: Path, manifest: dict, out: Path, merge: bool, progress: Callable[[str], None]
) -> tuple[dict[str, str], str]:
    """Each agent's weights into `out`; returns ({agent: directory name}, the base as the serve line names it)."""
    agents, mode = list(manifest["agents"]), manifest["agent_weights"]
    init_kwargs = dict(manifest.get("init_kwargs") or {})
    if manifest["base_name"] is None:  # an in-memory base: its weights travel with the export
        shutil.copytree(weights / "base", out / "base")
        load_ref, base = str(weights / "base"), "base"
    else:
        load_ref, base = manifest["base_name"], public_name(manifest["base_name"])
    if mode == "full":
        _save_full(weights, agents, out, progress)
        return {a: a for a in agents}, base
    dirs = {a: "shared" if mode == "shared" else a for a in agents}
    for agent, name in dirs.items():
        if (out / name).exists():  # shared: one directory for all
            continue
        source = weights / "adapters" / manifest["adapters"][agent]
        if merge:
            progress(f"merging {name}'s adapter into {manifest['base_name'] or 'the base'}")
            plain = {k: v for k, v in init_kwargs.items() if k not in _PLACEMENT_KEYS}
            _save_merged(source, load_ref, cfg.model.dtype, plain, out / name)
        else:
            progress(f"copying {name}'s adapter")
            adapter_base = str((out / "base").resolve()) if base == "base" else base
            _copy_adapter(source, out / name, adapter_base, init_kwargs.get("revision"))
    return dirs, base


def _copy_adapter(source: Path, dest: Path, base: str, revision: str | None) -> None:
    """The PEFT directory, its config naming `base` (checkpoints of earlier versions named a cache directory)."""
    for name in _ADAPTER_FILES:
        if not (source / name).is_file():
            raise MappaError(f"{source / name}: missing (checkpoint damaged)")
    dest.mkdir()
    shutil.copy2(source / "adapter_model.safetensors", dest / "adapter_model.safetensors")
    try:
        config = json.loads((source / "adapter_config.json").read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise MappaError(f"{source / 'adapter_config.json'}:{e.lineno}: invalid JSON") from None
    config.update(base_model_name_or_path=base, revision=revision)
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _save_merged(adapter: Path, base: str, dtype: str, init_kwargs: dict[str, Any], dest: Path) -> None:
    """A fresh base with `adapter` merged into its weights (peft's merge_and_unload), saved with its tokenizer."""
    from peft import PeftModel

    model, tokenizer = load_base_model(base, device="auto", dtype=dtype, init_kwargs=init_kwargs)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def _save_full(weights: Path, agents: list[str], out: Path, progress: Callable[[str], None]) -> None:
    """Full-weight agents: each one's own copy of the model, with the tokenizer."""
    from mappa.policy.policy import Policy

    progress(f"loading {weights}")
    policy = Policy.from_checkpoint(weights, device="auto")
    for agent in agents:
        progress(f"saving {agent}'s weights")
        with policy.active(agent) as module:
            module.save_pretrained(out / agent)
        policy.tokenizer.save_pretrained(out / agent)


# ----------------------------------------------------------------------------------------------------------------
# Serving and the model card


def vllm_lora_rank(r: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds rank `r`."""
    return next((v for v in VLLM_LORA_RANKS if v >= r), r)


def _serve_options(manifest: dict, cfg: Config, dirs: dict[str, str], base: str, merged: bool) -> dict[str, Any]:
    return {
        "base": base, "dirs": dirs, "merged": merged, "rank": int(manifest["lora"]["r"]),
        "init_kwargs": manifest.get("init_kwargs") or {}, "chat_template_kwargs": cfg.generation.chat_template_kwargs,
    }  # fmt: skip


def serve_lines(
    *,
    root: str,
    base: str,
    dirs: Mapping[str, str],
    merged: bool,
    rank: int,
    init_kwargs: Mapping[str, Any],
    chat_template_kwargs: Mapping[str, Any],
) -> list[str]:
    """The vLLM command lines that serve every agent under its own name, directories under `root`.

    Adapters: one server with the base and every agent's adapter (`--max-loras`: all of them in one batch).
    Whole models: one server per model directory, on ports 8000, 8001, ...; a shared model answers to every name.
    The run's chat_template_kwargs become the server's default, so prompts are templated as in training."""

    def where(directory: str) -> str:
        return shlex.quote(f"{root}/{directory}")

    options = ["--trust-remote-code"] if init_kwargs.get("trust_remote_code") else []
    if chat_template_kwargs:
        options += ["--default-chat-template-kwargs", shlex.quote(json.dumps(dict(chat_template_kwargs)))]
    if not merged:
        if init_kwargs.get("revision"):
            options += ["--revision", shlex.quote(str(init_kwargs["revision"]))]
        modules = " ".join(f"{shlex.quote(a)}={where(d)}" for a, d in dirs.items())
        served = where("base") if base == "base" else shlex.quote(base)
        line = f"vllm serve {served} --enable-lora --lora-modules {modules} --max-lora-rank {vllm_lora_rank(rank)}"
        return [" ".join([line, f"--max-loras {len(dirs)}", *options])]
    by_dir: dict[str, list[str]] = {}
    for agent, d in dirs.items():
        by_dir.setdefault(d, []).append(agent)
    return [
        " ".join(
            [f"vllm serve {where(d)} --served-model-name", *map(shlex.quote, names), f"--port {8000 + i}", *options]
        )
        for i, (d, names) in enumerate(by_dir.items())
    ]


def evaluation(run_dir: Path, step: int | None) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the eval/summary.jsonl record of `step`, else the last one or None; the eval/gain row of `step` in
    metrics.jsonl, or None), as `mappa.training.evaluate.write_eval` and the trainer write them."""
    rows = []
    path = run_dir / "eval" / "summary.jsonl"
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line of a killed run
            continue
    at_step = [r for r in rows if r.get("step") == step]
    summary = (at_step or rows or [None])[-1]
    gains = [r for r in read_metrics(run_dir) if "eval/gain" in r and r.get("step") == step]
    return summary, gains[-1] if gains else None


def model_card(
    cfg: Config, manifest: dict, ckpt: Path, step: int | None, dirs: dict[str, str], merged: bool,
    lines: list[str], run_dir: Path,
) -> str:  # fmt: skip
    """README.md: Hub metadata, what each directory holds, how to serve it, the run's settings and results."""
    base = public_name(manifest["base_name"]) if manifest["base_name"] else "base (included)"
    kind = "full model" if merged else "LoRA adapter (PEFT)"
    meta = {"base_model": base, "library_name": "transformers" if merged else "peft", "tags": ["mappa", "lora"]}
    if merged or manifest["base_name"] is None:
        meta.pop("base_model")
    out = ["---", *(f"{k}: {json.dumps(v)}" for k, v in meta.items()), "---", ""]
    out += [f"# {cfg.name}: {len(dirs)} agents trained with mappa", ""]
    out += [f"A team of agents ({cfg.workflow.name}) finetuned with per-action rewards from an AI coach "]
    out[-1] += f"({cfg.coach.backend}), exported from checkpoint `{ckpt.name}` (step {step}).\n"
    out += ["| agent | directory | weights |", "|---|---|---|"]
    out += [f"| {a} | `{d}/` | {kind} |" for a, d in dirs.items()]
    out += ["", "## Serve with vLLM", "", "From this directory:", "", "```bash", *lines, "```", ""]
    if manifest["base_name"] == "smollm2-135m-instruct" and not merged:
        out += ["The agents were trained on the Q4_1 GGUF of this base, dequantized; export with `--merge` for ",
                "their exact weights.", ""]  # fmt: skip
    out += ["## Settings", "", "| setting | value |", "|---|---|"]
    out += [f"| `{k}` | `{v}` |" for k, v in _settings(cfg)]
    out += ["", "## Results", ""] + _results(run_dir, step)
    return "\n".join(out) + "\n"


def _settings(cfg: Config) -> list[tuple[str, str]]:
    """The settings that tell runs apart, as (dotted key, value) from the run's config.yaml."""
    keys = [
        "model.name", "model.agent_weights", "model.lora_r", "model.lora_alpha", "model.lora_target_modules",
        "model.init_kwargs", "workflow.name", "coach.backend", "coach.model", "coach.outcome_weight", "tasks.train",
        "tasks.eval", "train.steps", "train.prompts_per_step", "train.samples_per_prompt", "train.lr",
        "train.kl_coef", "train.epochs", "generation.temperature", "generation.max_new_tokens",
        "generation.chat_template_kwargs", "seed",
    ]  # fmt: skip
    data = cfg.model_dump(mode="json")
    rows = []
    for key in keys:
        section, _, name = key.rpartition(".")
        value = data[section][name] if section else data[name]
        rows.append((key, value if isinstance(value, str) else json.dumps(value)))
    return rows


def _results(run_dir: Path, step: int | None) -> list[str]:
    summary, gain = evaluation(run_dir, step)
    if summary is None:
        return ["No evaluation recorded (eval/summary.jsonl)."]
    note = "" if summary.get("step") == step else f" (the checkpoint, step {step}, was not evaluated)"
    out = [f"Held-out evaluation `{summary.get('tag')}` at step {summary.get('step')}{note}:", ""]
    out += ["| metric | value |", "|---|---|"]
    for key, value in summary.items():
        if isinstance(value, int | float) and (key.endswith("accuracy") or key in ("eval/tasks", "eval/episodes")):
            out.append(f"| `{key}` | {value:.4g} |")
    return out + gain_lines(run_dir, str(summary.get("tag", "")), gain)


def gain_lines(run_dir: Path, tag: str, logged: dict[str, Any] | None) -> list[str]:
    """The gain of evaluation `tag` over the start one, computed from their episode files with intervals over
    tasks (`mappa.metrics.accuracy_gain`), so the card is right for runs logged before the gain counted tasks;
    the gain row logged in metrics.jsonl where the episode files are gone (or hold no episodes)."""
    g = eval_gain(run_dir / "eval", "start", tag) if re.fullmatch(r"[\w-]+", tag) and tag != "start" else None
    if g is not None and g.n_before and g.n_after:
        lo, hi = g.gain_ci
        return ["", f"Accuracy gain over the base (`start` to `{tag}`): {g.gain:+.3f} (95% interval {lo:.3f} to "
                f"{hi:.3f}; {g.method}, {g.n_after} episodes: a task's samples count as one task)."]  # fmt: skip
    if logged is None:
        return []
    low, high = logged.get("eval/gain_ci_low"), logged.get("eval/gain_ci_high")
    interval = f" (95% interval {low:.3f} to {high:.3f})" if low is not None and high is not None else ""
    return ["", f"Accuracy gain over the base: {logged['eval/gain']:+.3f}{interval}."]


# ----------------------------------------------------------------------------------------------------------------
# The Hub


def check_hub(repo: str) -> None:
    """Before any work: `repo` is a valid repository id and a Hub token is there (`hf auth login` or HF_TOKEN)."""
    from huggingface_hub import get_token
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise MappaError(f"--push-to-hub {repo}: not a repository id ({str(e).splitlines()[0][:160]})") from None
    if not get_token():
        raise MappaError(
            f"--push-to-hub {repo}: not logged in to the Hugging Face Hub (hf auth login, or set HF_TOKEN)"
        )


def push_to_hub(out: Path, repo: str) -> str:
    """Upload the export directory to the model repository `repo` (created when missing); returns its URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        url = api.create_repo(repo, repo_type="model", exist_ok=True)
        api.upload_folder(repo_id=repo, folder_path=str(out), repo_type="model", commit_message="mappa export")
    except Exception as e:  # noqa: BLE001 - network, auth and permission errors all come as one line
        text = (str(e).strip().splitlines() or [""])[0][:200]
        raise MappaError(f"--push-to-hub {repo}: upload failed ({type(e).__name__}: {text})") from None
    return str(url)
