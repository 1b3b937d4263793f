"""Every shipped preset loads, round-trips, and names things that exist (tasks, coach, workflow)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mappa.config import dump_config, load_config

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted((ROOT / "configs").glob("*.yaml"))
DATA = ROOT.parent / "shared" / "data" / "math"


def test_the_presets_are_all_there() -> None:
    assert {p.name for p in PRESETS} >= {"demo.yaml", "mathchat.yaml", "mathchat_outcome.yaml"}


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_preset_loads_and_round_trips(path: Path, tmp_path: Path) -> None:
    cfg = load_config(path)
    again = tmp_path / "resolved.yaml"
    again.write_text(dump_config(cfg))
    assert load_config(again) == cfg


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_preset_names_known_components(path: Path) -> None:
    from mappa.coach import COACHES
    from mappa.tasks import SOURCES
    from mappa.workflows import WORKFLOWS  # a broken install fails here, never skips

    cfg = load_config(path)
    assert cfg.coach.backend in COACHES
    assert set(cfg.tasks.train) <= set(SOURCES) and set(cfg.tasks.eval) <= set(SOURCES)
    assert cfg.workflow.name in WORKFLOWS


MATHCHAT_RUNS = [
    "mathchat.yaml", "mathchat_outcome.yaml", "mathchat_r1_1p5b.yaml", "mathchat_coach_flash_lite.yaml",
    "mathchat_coach_pro.yaml",
]  # fmt: skip


@pytest.mark.skipif(not DATA.is_dir(), reason="math data directory not present")
@pytest.mark.parametrize("name", MATHCHAT_RUNS)
def test_paper_presets_resolve_their_data(name: str) -> None:
    from mappa.tasks import load_tasks

    cfg = load_config(ROOT / "configs" / name, [f"tasks.data_dir={DATA}"])
    train = load_tasks(cfg.tasks.train, cfg.tasks, "train", cfg.seed)
    held_out = load_tasks(cfg.tasks.eval, cfg.tasks, "eval", cfg.seed)
    assert len(train) == 512
    assert [t.id for t in train[:3]] == ["aime-1983-1", "aime-1983-3", "aime-1983-4"]  # the published draw
    assert len(held_out) == 30 + 32  # AIME 2025 + the AMC eval set
    assert not {t.problem for t in train} & {t.problem for t in held_out}


def test_paper_settings() -> None:
    cfg = load_config(ROOT / "configs" / "mathchat.yaml")
    t = cfg.train
    assert (t.prompts_per_step, t.samples_per_prompt, t.steps) == (32, 2, 128)
    assert (t.kl_coef, t.clip_eps, t.gamma, t.grad_clip, tuple(t.adam_betas)) == (0.01, 0.2, 1.0, 1.0, (0.9, 0.95))
    assert (t.warmup_ratio, t.min_lr_ratio) == (0.03, 0.1)
    assert (t.mini_batch_size, t.epochs) == (16, 1)  # train_batch_size 16: 64-128 actions -> 4-8 optimizer steps
    assert (cfg.generation.max_new_tokens, cfg.eval.samples, cfg.eval.temperature) == (4096, 4, 0.6)
    assert cfg.coach.backend == "openai" and cfg.coach.temperature == 0.0


def test_outcome_baseline_differs_only_in_the_coach() -> None:
    process = load_config(ROOT / "configs" / "mathchat.yaml").model_dump()
    outcome = load_config(ROOT / "configs" / "mathchat_outcome.yaml").model_dump()
    assert outcome["coach"]["backend"] == "outcome"
    for section in ("model", "generation", "tasks", "train", "eval", "workflow"):
        assert process[section] == outcome[section], section


def test_demo_switches_to_an_llm_coach_with_one_override() -> None:
    cfg = load_config(ROOT / "configs" / "demo.yaml", ["coach.backend=openai"])
    assert cfg.coach.backend == "openai" and cfg.model.name == "smollm2-135m-instruct"


@pytest.mark.parametrize(
    ("name", "scale", "eval_every"),
    [("mathchat.yaml", 0.1, 4), ("mathchat_outcome.yaml", 0.1, 4), ("ds_pipeline.yaml", 1.0, 2)],
)
def test_paper_presets_scale_rewards_and_evaluate_as_the_paper(name: str, scale: float, eval_every: int) -> None:
    """method.md section 2: MathChat's coach score / 10, the data-science team's raw 0-10; the paper evaluated
    MathChat every 4 steps and the data-science team every 2."""
    cfg = load_config(ROOT / "configs" / name)
    assert cfg.workflow.reward_scale == scale and cfg.workflow.score_scale == scale
    assert cfg.train.eval_every == eval_every


@pytest.mark.parametrize("name", ["mathchat.yaml", "mathchat_outcome.yaml", "ds_pipeline.yaml"])
def test_paper_presets_reward_the_coachs_written_number(name: str) -> None:
    """The paper rewards the number the coach wrote; the expected score is an option, off in the paper presets."""
    assert load_config(ROOT / "configs" / name).coach.expected_score is False


@pytest.mark.parametrize("name", ["mathchat.yaml", "ds_pipeline.yaml"])
def test_paper_coaches_keep_their_thinking_apart_from_the_verdicts_room(name: str) -> None:
    """Gemini 2.5 thinks inside the token cap: an explicit budget on top of max_tokens keeps room for the verdict,
    and the request sends it as Gemini names it."""
    from mappa.coach.openai_backend import thinking_api, token_fields

    coach = load_config(ROOT / "configs" / name).coach
    assert coach.thinking_budget and coach.max_tokens >= 1024
    fields = token_fields(coach, thinking_api(coach.base_url))
    assert fields["max_tokens"] == coach.thinking_budget + coach.max_tokens
    assert fields["extra_body"]["google"]["thinking_config"]["thinking_budget"] == coach.thinking_budget


def test_the_demo_keeps_the_expected_score() -> None:
    assert load_config(ROOT / "configs" / "demo.yaml").coach.expected_score is True


def test_reward_scale_defaults_to_the_workflows_published_value() -> None:
    from mappa.config import WorkflowConfig

    assert WorkflowConfig(name="mathchat").score_scale == 0.1
    assert WorkflowConfig(name="ds_pipeline").score_scale == 1.0
    assert WorkflowConfig(name="ds_pipeline", reward_scale=0.1).score_scale == 0.1
    assert load_config(ROOT / "configs" / "ds_demo.yaml").workflow.score_scale == 1.0


@pytest.mark.parametrize("name", [*MATHCHAT_RUNS, "ds_pipeline.yaml"])
def test_paper_presets_run_the_published_prompts_loss_and_rules(name: str) -> None:
    """The paper presets as the paper ran them: its agent and coach prompts, every action weighing the same in the
    loss, its training draw; the data-science team stopping and capped as published."""
    cfg = load_config(ROOT / "configs" / name)
    assert cfg.workflow.prompts == "paper" and cfg.train.loss_aggregation == "action"
    assert cfg.workflow.show_coach_feedback is False
    if cfg.coach.backend != "outcome":
        assert cfg.coach.template == f"{cfg.workflow.name}_paper"
    if cfg.workflow.name == "ds_pipeline":
        assert cfg.workflow.ds_stop_when_done is False and cfg.workflow.ds_caps == "paper"
    else:
        assert cfg.tasks.train_draw == "paper"


@pytest.mark.parametrize("name", ["demo.yaml", "ds_demo.yaml"])
def test_the_demos_keep_our_measured_settings(name: str) -> None:
    cfg = load_config(ROOT / "configs" / name)
    w = cfg.workflow
    assert (w.prompts, w.ds_stop_when_done, w.ds_caps, cfg.coach.template) == ("mappa", True, "mappa", "")
    assert (cfg.train.loss_aggregation, cfg.tasks.train_draw) == ("token", "mappa")


@pytest.mark.parametrize(
    ("name", "differs"),
    [
        ("mathchat_r1_1p5b.yaml", {"name": "mathchat-r1-1.5b", "model": {"name": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"}}),
        ("mathchat_coach_flash_lite.yaml", {"name": "mathchat-coach-flash-lite", "coach": {
            "model": "gemini-2.0-flash-lite", "thinking_budget": None, "price_prompt_per_m": 0.075,
            "price_completion_per_m": 0.30}}),
        ("mathchat_coach_pro.yaml", {"name": "mathchat-coach-pro", "coach": {
            "model": "gemini-2.5-pro", "thinking_budget": 4096, "price_prompt_per_m": 1.25,
            "price_completion_per_m": 10.0}}),
    ],
)  # fmt: skip
def test_the_papers_other_runs_differ_from_mathchat_only_where_they_should(name: str, differs: dict) -> None:
    """The 1.5B team and the coach-strength ablation (one run per coach): mathchat.yaml with one change each."""
    base = load_config(ROOT / "configs" / "mathchat.yaml").model_dump()
    run = load_config(ROOT / "configs" / name).model_dump()
    for key, value in differs.items():
        if isinstance(value, dict):
            base[key].update(value)
        else:
            base[key] = value
    assert run == base
