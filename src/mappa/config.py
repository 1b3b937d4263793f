"""One typed config tree. YAML presets and `a.b=c` overrides load into the same classes.

Every field has a default and a description (its help line). Unknown keys and wrong types are
rejected with a message naming the key and the file: a typo must never silently fall back to a
default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mappa.errors import MappaError
from mappa.plugins import anchor, check_coach, check_task_loader, check_workflow, is_import_path, load_object


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    name: str = Field(
        "smollm2-135m-instruct",
        description="Base model: 'smollm2-135m-instruct' (embedded), a local HF dir, a cached hub id, or a .gguf file.",
    )
    agent_weights: Literal["lora", "full", "shared"] = Field(
        "lora",
        description="lora: one adapter per agent on one frozen base; full: a full copy per agent; "
        "shared: one adapter used by every agent (single-policy baseline).",
    )
    lora_r: int = Field(16, ge=1, description="LoRA rank.")
    lora_alpha: int = Field(32, ge=1, description="LoRA alpha (scaling = alpha / r).")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout.")
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Module names that get LoRA adapters.",
    )
    device: str = Field("auto", description="'auto' (cuda if available else cpu), 'cpu', 'cuda', 'cuda:1', ...")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="'auto': bfloat16 on CUDA, float32 on CPU."
    )
    gradient_checkpointing: bool = Field(False, description="Trade compute for memory in the update phase.")
    init_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Passed to the base model's from_pretrained: attn_implementation, quantization_config (a dict), "
        "trust_remote_code (tokenizer too), revision (a cached hub id's snapshot), device_map, ... dtype/torch_dtype "
        "here are model.dtype: give one, or the same value. Recorded in checkpoints (docs/models.md).",
    )


class GenerationConfig(Section):
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature for training rollouts.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling for training rollouts.")
    max_new_tokens: int = Field(256, ge=1, description="Per-action token cap.")
    max_context_tokens: int = Field(2048, ge=16, description="Longest prompt an agent may see; longer is an error.")
    batch_size: int = Field(16, ge=1, description="Most sequences in one generate call (larger batches are split).")
    backend: Literal["local", "server"] = Field(
        "local",
        description="local: the trainer's own policy generates; server: an OpenAI-compatible LoRA server "
        "(vLLM, SGLang or `mappa serve`) at base_url, reloaded with every agent's adapter after each step.",
    )
    base_url: str = Field("http://127.0.0.1:8000/v1", description="server backend: the server's OpenAI base URL.")
    adapter_api: Literal["vllm", "sglang"] = Field(
        "vllm",
        description="server backend: adapter loading endpoints; vllm: {base_url}/load_lora_adapter (also "
        "`mappa serve`), sglang: /load_lora_adapter at the server root.",
    )
    adapter_dir: str = Field(
        "",
        description="server backend: where adapters are published (<dir>/<agent>/v<step>); empty: <run_dir>/adapters.",
    )
    server_adapter_dir: str = Field(
        "",
        description="server backend: the same directory as the server sees it (shared storage); empty: adapter_dir.",
    )
    concurrency: int = Field(32, ge=1, description="server backend: requests in flight at once.")
    timeout_s: float = Field(600.0, gt=0, description="server backend: per-request timeout.")
    api_key_env: str = Field(
        "MAPPA_API_KEY",
        description="server backend: environment variable holding the server's API key, sent as "
        "`Authorization: Bearer` when set (`mappa serve` reads MAPPA_API_KEY too; vLLM: VLLM_API_KEY).",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra variables of the chat template (e.g. enable_thinking: false for Qwen3), the same for the "
        "trainer's prompts, the local policy and every server request (`chat_template_kwargs` in its body).",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(set(value) & {"messages", "conversation", "tokenize", "add_generation_prompt"})
        if taken:
            raise ValueError(f"{', '.join(taken)}: set by mappa itself, not a template variable")
        return value


class SandboxConfig(Section):
    timeout_s: float = Field(10.0, gt=0, description="Wall-clock limit per snippet.")
    memory_mb: int = Field(
        1024, ge=64, description="Resident-memory limit per snippet (MB, all its processes; a watchdog kills above)."
    )
    max_processes: int = Field(64, ge=1, description="Process-count limit per snippet (fork bombs).")
    max_file_mb: int = Field(64, ge=1, description="Largest file a snippet may write.")
    max_output_chars: int = Field(8000, ge=100, description="stdout/stderr kept per snippet (rest cut with a marker).")
    concurrency: int = Field(2, ge=1, description="Snippets running at once.")
    pool: bool = Field(True, description="Use a warm pool of pre-imported workers (numpy, pandas, sklearn).")
    preload: list[str] = Field(
        default_factory=lambda: ["numpy", "pandas", "sklearn"], description="Modules the warm pool pre-imports."
    )
    keep_workspaces: bool = Field(False, description="Keep per-episode workspaces for inspection.")
    observation_chars: int = Field(2000, ge=100, description="Longest tool observation an agent sees.")
    confinement: Literal["auto", "bwrap", "fallback"] = Field(
        "auto", description="auto: bubblewrap when it works, else the fallback (warned); bwrap: required; fallback."
    )
    python: str | None = Field(
        None,
        description="The agent environment's interpreter (what agent code may import); default: "
        "$MAPPA_AGENT_PYTHON, else .venv-agents/bin/python (made by `make`), else the trainer's own Python.",
    )
    max_open_files: int = Field(256, ge=16, description="Open-file limit per snippet process (RLIMIT_NOFILE).")
    allow_unconfined: bool = Field(
        False,
        description="Train or evaluate on tasks with hidden answers even where the sandbox cannot hide them "
        "(every run line then says the answers are reachable).",
    )


# The built-in names (`mappa.coach.COACHES`, `mappa.workflows.WORKFLOWS`; a test checks they agree); anything
# else is a plug-in's import path (`mappa.plugins`), imported and checked when the config loads.
BUILTIN_COACHES = ("rubric", "outcome", "openai", "local")
BUILTIN_WORKFLOWS = ("mathchat", "ds_pipeline")


def _builtin_or_plugin(value: str, builtins: tuple[str, ...], key: str, check: Any) -> str:
    if value in builtins:
        return value
    if not is_import_path(value):
        raise ValueError(f"{value!r} is neither one of {', '.join(builtins)} nor an import path 'module:name'")
    try:
        check(load_object(value, key), key)
    except MappaError as e:  # its text already names the key; pydantic adds it again
        raise ValueError(str(e).removeprefix(f"{key}: ")) from None
    return value


class CoachConfig(Section):
    backend: str = Field(
        "rubric",
        description="rubric: offline rules; outcome: 10/0 on the final answer; openai: any "
        "OpenAI-compatible endpoint; local: an in-process HF model; or a plug-in 'module:name' / 'file.py:name': "
        "a coach class, a factory f(cfg) -> coach, or a reward function f(ctx) -> 0-10 or None (docs/your-team.md).",
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="A plug-in coach's own settings (it reads them from its CoachConfig)."
    )
    outcome_weight: float = Field(
        0.0, ge=0.0, le=1.0, description="Mix in the episode's outcome: each action's score becomes "
        "(1 - w) * coach score + w * (10 if the episode succeeded else 0); 0: process rewards alone.",
    )  # fmt: skip
    model: str = Field("", description="Coach model name (openai) or model path/name (local).")
    base_url: str | None = Field(None, description="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1.")
    api_key_env: str = Field("OPENAI_API_KEY", description="Environment variable that holds the API key.")
    template: Literal["", "mathchat", "ds_pipeline", "generic"] = Field(
        "", description="Prompt template name; empty: the workflow's own, else generic."
    )
    temperature: float = Field(0.0, ge=0.0, description="Coach sampling temperature (0: deterministic).")
    max_tokens: int = Field(512, ge=16, description="Longest coach reply.")
    max_context_tokens: int | None = Field(
        None,
        ge=64,
        description="Coach context (prompt + reply) in tokens; evidence over it loses its oldest input messages "
        "first (never the output). None: the backend's default, the local model's own context; 32768 for the "
        "openai backend (mappa.coach.openai_backend.DEFAULT_CONTEXT_TOKENS). Every backend has a budget.",
    )
    tokenizer: str = Field(
        "",
        description="Tokenizer that counts coach prompts (a local HF dir or cached hub id); empty: the coach "
        "model's own when available offline, else UTF-8 bytes (an upper bound on tokens).",
    )
    concurrency: int = Field(8, ge=1, description="Coach calls in flight at once.")
    timeout_s: float = Field(60.0, gt=0, description="Per-request timeout.")
    max_retries: int = Field(4, ge=0, description="Retries on 429/5xx/timeouts (exponential backoff with jitter).")
    expected_score: bool = Field(
        True, description="Score = probability-weighted mean over score tokens when logprobs are available."
    )
    cache: bool = Field(True, description="Cache judgments in SQLite; re-scoring costs zero calls.")
    cache_path: str = Field("", description="SQLite cache file; empty: <MAPPA_CACHE>/coach_cache.sqlite.")
    on_unscored: Literal["skip", "neutral"] = Field(
        "skip", description="Unscored actions: skip = left out of training; neutral = score 5."
    )
    price_prompt_per_m: float = Field(0.0, ge=0, description="USD per million prompt tokens (cost accounting).")
    price_completion_per_m: float = Field(0.0, ge=0, description="USD per million completion tokens.")

    @field_validator("backend")
    @classmethod
    def _backend(cls, value: str) -> str:
        return _builtin_or_plugin(value, BUILTIN_COACHES, "coach.backend", check_coach)

    @property
    def is_plugin(self) -> bool:
        return self.backend not in BUILTIN_COACHES


# The coach's 0-10 score times this is the reward on an action's last token (method.md section 2): the
# published MathChat code divides by 10, the published data-science code keeps the raw score. After whitening
# the scale only sets the KL penalty's weight against the score (10x lighter with the raw score).
PAPER_REWARD_SCALE = {"mathchat": 0.1, "ds_pipeline": 1.0}


class WorkflowConfig(Section):
    name: str = Field(
        "mathchat",
        description="mathchat, ds_pipeline (mappa.workflows.WORKFLOWS), or a plug-in 'module:name' / 'file.py:name' "
        "built like them: f(workflow_cfg, generation_cfg, sandbox_cfg) -> workflow (docs/your-team.md).",
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="A plug-in workflow's own settings (it reads them from its WorkflowConfig)."
    )
    coder_max_turns: int = Field(2, ge=1, description="MathChat: Code Executor turn cap.")
    ds_max_turns: int = Field(4, ge=1, description="ds_pipeline: turn cap of each agent.")
    show_coach_feedback: bool = Field(
        False, description="Later agents see earlier agents' coach rationales (off in the published code)."
    )
    reward_scale: float | None = Field(
        None, gt=0, description="The coach's 0-10 score times this is the reward on an action's last token; "
        "default: the workflow's published value (mathchat 0.1, i.e. score / 10; ds_pipeline 1.0, the raw score).",
    )  # fmt: skip

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _builtin_or_plugin(value, BUILTIN_WORKFLOWS, "workflow.name", check_workflow)

    @property
    def score_scale(self) -> float:
        """`reward_scale`, or the workflow's published value when it is not set (a plug-in: score / 10)."""
        return PAPER_REWARD_SCALE.get(self.name, 0.1) if self.reward_scale is None else self.reward_scale


class TasksConfig(Section):
    data_dir: str | None = Field(None, description="Directory of the math data; default $MAPPA_DATA_DIR.")
    train: list[str] = Field(
        default_factory=lambda: ["arithmetic"],
        description="Training sources: built-in names (mappa.tasks.SOURCES), 'jsonl:PATH' (one task a line), "
        "'hf:NAME[:SPLIT]' (a datasets directory or cached hub dataset), or a plug-in 'module:name' / "
        "'file.py:name', a function (split, seed) -> tasks.",
    )
    eval: list[str] = Field(
        default_factory=lambda: ["arithmetic"], description="Held-out evaluation sources (as for train)."
    )
    train_size: int | None = Field(None, ge=1, description="Draw this many training tasks (seeded); None: all.")
    eval_size: int | None = Field(None, ge=1, description="Use this many eval tasks (seeded); None: all.")
    arithmetic_levels: list[int] = Field(
        default_factory=lambda: [1, 2, 3], description="Difficulty levels of the generated arithmetic tasks."
    )
    arithmetic_train_size: int = Field(512, ge=1, description="Generated arithmetic training tasks.")
    arithmetic_eval_size: int = Field(32, ge=1, description="Generated arithmetic eval tasks (disjoint seed).")
    dsbench_dir: str | None = Field(
        None,
        description="The mini-DSBench directory (source 'dsbench'); default $MAPPA_DSBENCH_DIR, else "
        "<MAPPA_CACHE>/dsbench, built there on first use.",
    )

    @field_validator("train", "eval")
    @classmethod
    def _loaders(cls, names: list[str], info: Any) -> list[str]:
        for name in names:  # built-in names and data files are checked when they load (they may be large)
            if is_import_path(name):
                _builtin_or_plugin(name, (), f"tasks.{info.field_name}", check_task_loader)
        return names


class TrainConfig(Section):
    steps: int = Field(10, ge=0, description="Training steps: one rollout batch each, then the agents' updates.")
    prompts_per_step: int = Field(4, ge=1, description="Tasks per step.")
    samples_per_prompt: int = Field(2, ge=1, description="Episodes per task per step.")
    lr: float = Field(1e-6, gt=0, description="Learning rate (peak).")
    agent_lr: dict[str, float] = Field(default_factory=dict, description="Per-agent learning rate overrides.")
    warmup_ratio: float = Field(0.03, ge=0, le=1, description="Linear warm-up fraction of steps.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine decays to this fraction of lr.")
    adam_betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient-norm clip per agent.")
    kl_coef: float = Field(0.01, ge=0, description="k1 KL penalty in the token reward (not the loss).")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount within an action.")
    clip_eps: float = Field(0.2, gt=0, description="PPO ratio clip.")
    mini_batch_size: int = Field(
        16, ge=1, description="Actions per optimizer step, per agent (the paper's train_batch_size 16)."
    )
    epochs: int = Field(1, ge=1, description="Passes over each rollout batch (reshuffled into mini-batches).")
    stratify_by: str = Field(
        "", description="Task.meta key (e.g. data_type) whose values every step's tasks hold in proportion; "
        "empty: a plain shuffle.",
    )  # fmt: skip
    micro_batch_size: int = Field(4, ge=1, description="Sequences per forward/backward (gradient accumulation).")
    recompute_old_logprobs: bool = Field(
        True,
        description="PPO's old log-probs from a training forward pass before the first optimizer step "
        "(generation kernels differ; in bf16 enough to trip the clip); false: the generation-time ones.",
    )
    cpu_autocast: Literal["auto", "bf16", "off"] = Field(
        "auto",
        description="The update's forward/backward on a CPU under bfloat16 autocast (float32 weights): 'auto' where it "
        "pays (AMX or AVX-512 BF16, hidden size >= 256), 'bf16' always, 'off' never; under it the old log-probs are "
        "always recomputed. CUDA: ignored.",
    )
    drop_truncated: bool = Field(True, description="Leave actions cut off by the token cap out of the loss.")
    eval_every: int = Field(0, ge=0, description="Evaluate every N steps (0: only at start and end).")
    checkpoint_every: int = Field(1, ge=1, description="Checkpoint every N steps.")
    keep_checkpoints: int = Field(
        2, ge=0, description="Newest complete checkpoints kept, older ones deleted; 0: keep every one (`mappa probe` "
        "then measures specialisation and forgetting at every checkpoint).",
    )  # fmt: skip
    self_test: bool = Field(True, description="Run the self-test before the first step, and again on every resume.")
    max_unscored_steps: int = Field(
        3, ge=0, description="Stop the run after this many consecutive steps in which the coach scored no action "
        "(an endpoint that went down); 0: never stop.",
    )  # fmt: skip
    gpus_per_agent: float = Field(
        0.0, ge=0, description="With --ray: GPUs each update group's trainer reserves; 0 on a CPU, a fraction "
        "lets trainers share a GPU, a whole number above 1 shards the group over that many GPUs (fsdp_ranks).",
    )  # fmt: skip
    fsdp_ranks: int | None = Field(
        None, ge=1, description="With --ray: processes an update group's trainer spans, its weights, gradients and "
        "AdamW state sharded over them with FSDP2 (one GPU each; gloo between CPU processes when gpus_per_agent "
        "is 0). Default: gpus_per_agent when that is above 1, else 1.",
    )  # fmt: skip

    @model_validator(mode="after")
    def _sharding(self) -> TrainConfig:
        g, n = self.gpus_per_agent, self.fsdp_ranks
        if g > 1 and g != int(g):
            raise ValueError(
                f"gpus_per_agent: {g:g} GPUs cannot be split over whole ranks; give 0-1 or a whole number"
            )
        if n is not None and n > 1 and 0 < g <= 1:
            raise ValueError(f"fsdp_ranks: {n} ranks need a GPU each (gpus_per_agent: {n}) or none (0), not {g:g}")
        if n is not None and g > 1 and n != g:
            raise ValueError(
                f"fsdp_ranks: {n} ranks for gpus_per_agent {g:g}; each rank takes one GPU, so they must match"
            )
        return self

    @property
    def ranks(self) -> int:
        """Processes per update group's trainer (`fsdp_ranks`, or the whole GPUs asked for)."""
        return self.fsdp_ranks or (int(self.gpus_per_agent) if self.gpus_per_agent > 1 else 1)

    @property
    def gpus_per_rank(self) -> float:
        return self.gpus_per_agent / self.ranks if self.gpus_per_agent > 1 else self.gpus_per_agent


class EvalConfig(Section):
    samples: int = Field(1, ge=1, description="Samples per eval task.")
    temperature: float = Field(0.6, ge=0, description="Eval sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Eval nucleus sampling.")
    max_tasks: int | None = Field(None, ge=1, description="Evaluate on at most this many tasks.")


class LoggingConfig(Section):
    """Where metrics go besides metrics.jsonl, which is always written and is the ground truth (docs/training.md)."""

    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = Field(
        default_factory=lambda: ["tensorboard"],
        description="Experiment trackers the metrics also go to ([] for none); one whose package is not "
        "installed is skipped with a note. `--resume` continues the same tracked run (ids kept in run.json).",
    )
    project: str = Field("mappa", min_length=1, description="W&B project, MLflow experiment and trackio project.")

    @model_validator(mode="before")
    @classmethod
    def _old_keys(cls, data: Any) -> Any:
        """`report_to: wandb,mlflow` (one string, as `--set` gives it) is a list; the keys of earlier versions
        are still read (old runs' config.yaml has them): `tensorboard: true/false` adds/removes tensorboard in
        report_to, `wandb_project: NAME` adds wandb and sets project."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        report_to = data.get("report_to", ["tensorboard"])
        if isinstance(report_to, str):
            data["report_to"] = report_to = [r.strip() for r in report_to.split(",") if r.strip()]
        if not isinstance(report_to, list) or not {"tensorboard", "wandb_project"} & data.keys():
            return data  # a wrong type is pydantic's to name
        report_to = list(report_to)
        tensorboard = data.pop("tensorboard", None)
        if tensorboard is not None and not isinstance(tensorboard, bool):
            raise ValueError(f"tensorboard must be true or false, got {tensorboard!r} (or use report_to)")
        if tensorboard and "tensorboard" not in report_to:
            report_to.append("tensorboard")
        elif tensorboard is False:
            report_to = [r for r in report_to if r != "tensorboard"]
        project = data.pop("wandb_project", None)
        if project is not None:
            if data.get("project", project) != project:
                raise ValueError(f"wandb_project={project!r} and project={data['project']!r}: keep only project")
            report_to += [] if "wandb" in report_to else ["wandb"]
            data["project"] = project
        data["report_to"] = report_to
        return data

    @field_validator("report_to")
    @classmethod
    def _no_repeats(cls, value: list[str]) -> list[str]:
        return list(dict.fromkeys(value))


class AnalysisConfig(Section):
    """The alarms of `mappa report` (docs/analysis.md); read from the run's config.yaml, `--set` overrides."""

    alarm_alpha: float = Field(
        0.05, gt=0, lt=1, description="False-alarm rate of one run: shared among the run's comparisons "
        "(Bonferroni) for each alarm, so a run with no bias and no hacking raises each at most this often.",
    )  # fmt: skip
    bias_gap: float = Field(
        0.5, ge=0, description="Bias alarm: a stratum's coach score this many points (0-10) above or below the "
        "other strata's beyond what the ground truth predicts, with a simultaneous interval that excludes 0.",
    )  # fmt: skip
    bias_drift: float = Field(
        0.5, ge=0, description="Bias alarm: that gap moving this many points from the first half of the steps "
        "to the second (interval excludes 0).",
    )  # fmt: skip
    min_stratum_actions: int = Field(
        8, ge=2, description="Scored actions a stratum needs before it can raise an alarm."
    )
    min_stratum_tasks: int = Field(
        8, ge=2, description="Distinct tasks a stratum, and the rest of its split, need before it is judged."
    )
    hacking_gap: float = Field(
        0.05, ge=0, description="Hacking alarm: an agent's score rise over the run beyond what its episodes' "
        "outcomes explain (score/10, 0-1), at least this much with an interval above 0, while accuracy (held-out "
        "where evaluated) rose less than the scores.",
    )  # fmt: skip
    hacking_min_steps: int = Field(
        5, ge=3, description="Training steps with scored episodes the hacking alarm needs (a trend of fewer "
        "points cannot be told from noise).",
    )  # fmt: skip
    high_score: float = Field(
        7.0, ge=0, le=10, description="A final agent's score at or above this reads as 'answer right' when the "
        "coach gave no ANSWER_CORRECT verdict.",
    )  # fmt: skip


class RayConfig(Section):
    """`mappa train --ray`: where the work runs (docs/scale.md). The local mode reads none of it."""

    rollout_workers: int = Field(2, ge=1, description="Rollout worker actors; each plays a share of every batch.")
    worker_cpus: float = Field(1.0, gt=0, description="CPUs each rollout worker reserves (its sandbox runs there).")
    worker_gpus: float = Field(0.0, ge=0, description="GPUs each rollout worker reserves (local generation on a GPU).")
    trainer_cpus: float = Field(1.0, gt=0, description="CPUs each trainer actor reserves.")
    base_urls: list[str] = Field(
        default_factory=list,
        description="generation.backend=server: one server per entry (e.g. one vLLM engine per GPU); rollout "
        "worker i uses entry i mod n, and each server loads every step's adapters. Empty: generation.base_url.",
    )
    placement_timeout_s: float = Field(
        120.0, gt=0, description="How long to wait for the cluster to find room for every actor."
    )


class Config(Section):
    seed: int = Field(42, description="One seed for data sampling, generation and init.")
    run_dir: str = Field("runs/{name}-{time}", description="Run directory; {name} and {time} are filled in.")
    name: str = Field("run", description="Run name.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    coach: CoachConfig = Field(default_factory=CoachConfig)
    workflow: WorkflowConfig = Field(default_factory=WorkflowConfig)
    tasks: TasksConfig = Field(default_factory=TasksConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    analysis: AnalysisConfig = Field(default_factory=AnalysisConfig)
    ray: RayConfig = Field(default_factory=RayConfig)


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise MappaError(f"override {key!r}: {p!r} is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=c` -> ("a.b", value parsed as YAML, so 3 is an int, [1,2] a list, null None)."""
    if "=" not in text:
        raise MappaError(f"override {text!r}: expected KEY=VALUE, e.g. train.steps=5")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise MappaError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def config_from_dict(data: dict[str, Any], source: str = "<config>") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            raise MappaError(f"{source}: unknown key {loc!r}") from None
        msg = err["msg"].removeprefix("Value error, ")
        raise MappaError(f"{source}: {loc}: {msg} (got {err.get('input')!r})") from None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML preset (or the defaults when `path` is None) and apply `a.b=c` overrides."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise MappaError(f"{p}: config file not found")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f":{mark.line + 1}" if mark is not None else ""
            raise MappaError(f"{p}{where}: invalid YAML") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise MappaError(f"{p}: top level must be a mapping of sections")
        data = _anchored(loaded, p.parent)
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
    if overrides:
        source += " (with --set overrides)"
    return config_from_dict(data, source)


def _anchored(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """Relative plug-in files and `jsonl:` task files named in a config file resolve against its directory, so
    `mappa train examples/x/config.yaml` works from anywhere and the run directory records absolute paths."""

    def fix(section: str, key: str) -> None:
        node = data.get(section)
        if not isinstance(node, dict) or key not in node:
            return
        value = node[key]
        if isinstance(value, str):
            node[key] = _anchor_one(value, base)
        elif isinstance(value, list):
            node[key] = [_anchor_one(v, base) if isinstance(v, str) else v for v in value]

    for section, key in (("workflow", "name"), ("coach", "backend"), ("tasks", "train"), ("tasks", "eval")):
        fix(section, key)
    return data


def _anchor_one(value: str, base: Path) -> str:
    if value.startswith("jsonl:") and not Path(value[6:]).expanduser().is_absolute():
        return f"jsonl:{(base / value[6:]).resolve()}"
    if value.startswith("hf:"):  # a dataset directory beside the config file; else a hub id (or cwd-relative)
        name, sep, split = value[3:].partition(":")
        if name and not Path(name).expanduser().is_absolute() and (base / name).is_dir():
            return f"hf:{(base / name).resolve()}{sep}{split}"
    return anchor(value, base)


def dump_config(cfg: Config) -> str:
    """YAML text that `load_config` reads back into an equal Config."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
