"""The config sections of training and what watches it: train, eval, logging, analysis and ray.

`mappa.config` assembles these and `mappa.config_rollout`'s sections into `Config` and re-exports them; import
them from there.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from mappa.config_rollout import Section, yaml_off


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
    loss_aggregation: Literal["token", "action"] = Field(
        "token",
        description="How a mini-batch's clipped surrogate is averaged. token: one mean over all its tokens (a long "
        "action weighs in proportion to its length); action: each action's token mean, then the mean over its "
        "actions (every action weighs the same: the published code, docs/method.md section 2).",
    )
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
    _cpu_autocast_off = field_validator("cpu_autocast", mode="before")(yaml_off)
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

    @field_validator("report_to", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        """`report_to: wandb,mlflow` (one string, as `--set` gives it) is a list."""
        return [r.strip() for r in value.split(",") if r.strip()] if isinstance(value, str) else value

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
