"""The config sections an episode runs on: model, generation, sandbox, coach, workflow and tasks.

`Section` is every section's base (unknown keys rejected, assignments validated). `mappa.config` assembles these
and `mappa.config_training`'s sections into `Config` and re-exports them; import them from there.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from mappa.errors import MappaError
from mappa.plugins import check_coach, check_task_loader, check_workflow, is_import_path, load_object
from mappa.protocols import SamplingSettings


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def yaml_off(value: Any) -> Any:
    """A mode named "off" written bare (`sampling_copy: off`, `--set train.cpu_autocast=off`): YAML 1.1 reads it
    as false, which was never meant as anything else."""
    return "off" if value is False else value


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
    agent_models: dict[str, str] = Field(
        default_factory=dict,
        description="A heterogeneous team: agent -> the base model it runs on, named as `name` is (e.g. {verifier: "
        "qwen2.5-coder-0.5b-instruct}); agents not listed run on `name`. Agents on one base share it, with their "
        "own weights each; every other setting here applies to every base (docs/models.md).",
    )

    @field_validator("agent_models")
    @classmethod
    def _agent_models(cls, value: dict[str, str]) -> dict[str, str]:
        if empty := sorted(agent for agent, name in value.items() if not name.strip()):
            raise ValueError(f"{', '.join(empty)}: an empty model name (leave the agent out to use model.name)")
        return value

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
    sampling_copy: Literal["auto", "off", "float32", "bfloat16"] = Field(
        "auto",
        description="local backend on a CPU: sample from a copy of each agent's weights with its adapter folded in, "
        "refreshed after each update (docs/models.md). float32: the same distribution, 1.5-1.8x generation; bfloat16: "
        "2.3-2.5x with native bf16 (old log-probs then recomputed in the update's precision); auto: bfloat16 where the "
        "update runs under bf16 autocast (train.cpu_autocast), else off. Costs one base-sized copy per agent.",
    )
    _sampling_copy_off = field_validator("sampling_copy", mode="before")(yaml_off)
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

    def sampling(self, temperature: float | None = None, top_p: float | None = None) -> SamplingSettings:
        """How episodes sample (`mappa.workflows.runtime.play`): these settings, or evaluation's temperature and
        top-p with the same token caps."""
        return SamplingSettings(
            self.temperature if temperature is None else temperature, self.top_p if top_p is None else top_p,
            self.max_new_tokens, self.max_context_tokens,
        )  # fmt: skip


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


# Thinking tokens per reasoning_effort level, as Gemini's OpenAI-compatible API maps them (OpenAI publishes no
# numbers): the room a request keeps for thinking when only the effort is set.
EFFORT_THINKING_TOKENS = {"none": 0, "minimal": 1024, "low": 1024, "medium": 8192, "high": 24576}


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
    judge: Literal["generate", "logprob"] = Field(
        "generate",
        description="How the local coach gives its verdict. generate: it writes an analysis and the verdict lines "
        "(parsed; one follow-up when missing). logprob: one forward pass over the same prompt with the verdict's "
        "marker appended; the score is the expected value of the next token's distribution over 0-10 (the most "
        "likely value with expected_score: false), never unparsable, judgments batched (docs/coach.md).",
    )
    base_url: str | None = Field(None, description="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1.")
    api_key_env: str = Field("OPENAI_API_KEY", description="Environment variable that holds the API key.")
    template: Literal["", "mathchat", "ds_pipeline", "generic", "mathchat_paper", "ds_pipeline_paper"] = Field(
        "",
        description="Prompt template name; empty: the workflow's own, else generic. mathchat_paper, ds_pipeline_paper: "
        "the published coach prompts verbatim, the evidence fenced (mappa.coach.paper_templates).",
    )
    temperature: float = Field(0.0, ge=0.0, description="Coach sampling temperature (0: deterministic).")
    max_tokens: int = Field(
        512, ge=16, description="The room for the coach's written reply (analysis and verdict lines), on top of its "
        "thinking (coach.thinking_budget); a reply cut at the cap without a verdict is asked again with twice this.",
    )  # fmt: skip
    thinking_budget: int | None = Field(
        None,
        ge=0,
        description="Tokens a thinking coach may spend thinking, kept apart from max_tokens: the request's token cap "
        "is their sum. Sent as the endpoint names it (Gemini: google.thinking_config.thinking_budget; Anthropic: "
        "thinking.budget_tokens); other OpenAI-compatible endpoints take no budget, so it only sizes the cap there. "
        "0: thinking off where the model allows; None: the endpoint's default (set it for thinking models, whose "
        "thinking otherwise eats the reply's room).",
    )
    reasoning_effort: Literal["", "none", "minimal", "low", "medium", "high"] = Field(
        "",
        description="Sent as reasoning_effort (OpenAI reasoning models, Gemini); empty: not sent. Without a "
        "thinking_budget the cap keeps room for the thinking that Gemini gives each level (none 0, minimal and low "
        "1024, medium 8192, high 24576).",
    )
    max_context_tokens: int | None = Field(
        None,
        ge=64,
        description="Coach context (prompt + replies) in tokens; evidence over it loses its oldest input messages "
        "first, then every long field its middle. None: the backend's default, the local model's own context; "
        "32768 for the openai backend (mappa.coach.openai_backend.DEFAULT_CONTEXT_TOKENS). Every backend has a "
        "budget.",
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
        True,
        description="Score = the probability-weighted mean over the score token's alternatives when the endpoint "
        "returns logprobs (one warning when it returns none); false: the number the coach wrote, as the paper.",
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

    @field_validator("judge")
    @classmethod
    def _judge(cls, value: str, info: ValidationInfo) -> str:
        backend = info.data.get("backend")  # absent when the backend itself failed validation
        if value == "logprob" and backend is not None and backend != "local":
            raise ValueError(
                f"logprob reads the next-token distribution of an in-process model: it needs coach.backend: local "
                f"(coach.backend is {backend!r})"
            )
        return value

    @property
    def is_plugin(self) -> bool:
        return self.backend not in BUILTIN_COACHES

    @property
    def thinking_tokens(self) -> int:
        """The room kept for thinking: `thinking_budget`, else the effort's budget as Gemini defines it, else 0."""
        if self.thinking_budget is not None:
            return self.thinking_budget
        return EFFORT_THINKING_TOKENS.get(self.reasoning_effort, 0)

    def reply_cap(self, reply_tokens: int | None = None) -> int:
        """A request's token cap: the thinking room plus the written reply's (`max_tokens` unless given)."""
        return self.thinking_tokens + (self.max_tokens if reply_tokens is None else reply_tokens)


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
    answer_form: Literal["auto", "boxed", "line"] = Field(
        "auto",
        description="MathChat (our prompts): how the Verifier is asked to give the answer. boxed: \\boxed{...}; "
        "line: one line 'The answer is <number>.'; auto: line for generated arithmetic (what SmolLM2-135M "
        "follows), boxed otherwise. Qwen2.5-Coder-0.5B boxes 8 of 32 answers at the start where it writes the line in 1, "
        "but boxed it writes more and is cut off sooner (docs/learning.md).",
    )
    prompts: Literal["mappa", "paper"] = Field(
        "mappa",
        description="What the built-in workflows' agents are told. mappa: our prompts (a system prompt with the role, "
        "a closing ask; measured on the demo); paper: the published code's templates verbatim "
        "(mappa.workflows.paper_prompts).",
    )
    ds_stop_when_done: bool = Field(
        True,
        description="ds_pipeline: an agent also stops once its code ran cleanly and all its required files exist "
        "and count; false: only at a reply without code or its turn cap, as the paper.",
    )
    ds_caps: Literal["mappa", "paper"] = Field(
        "mappa",
        description="ds_pipeline: the score caps enforced on the Analyst (mappa.coach.caps). mappa: the paper's "
        "tables plus the share of the reference model's gain and the trivial-prediction cap; paper: the published "
        "coach prompt's rules alone (tables, RMSE as a share of the IQR for an outlier-heavy target, the upstream-"
        "fault exception up to 8).",
    )
    show_coach_feedback: bool = Field(
        False,
        description="Later agents see the coach's score and rationale of each earlier action whose text they are "
        "shown (MathChat and ds_pipeline; off in the published code).",
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
    train_draw: Literal["mappa", "paper"] = Field(
        "mappa",
        description="How train_size tasks are drawn. mappa: random.Random(seed).sample of the pool once every "
        "evaluation problem (configured, and the paper's held-out sets) is removed; paper: the published code's "
        "numpy RandomState(seed).choice over the sources' rows in file order, sorted, and refused when it holds a "
        "configured evaluation problem (docs/method.md section 4).",
    )
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
