"""Sampling copies (`mappa.policy.sampling_copies`): `generate` samples from a copy of each agent's weights with its
adapter folded in. In float32 the copy samples what the forward pass computes; a copy follows its agent's weights
through optimizer steps, loads and the self-test's perturbation; a bfloat16 copy stays within the self-test's bf16
tolerance. Tiny random Llama, in-process."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import AGENTS, convs, first_update_step, make_policy, perturb, solver_actions

from mappa.config import Config
from mappa.errors import MappaError
from mappa.policy import sampling_copies
from mappa.policy.models import tiny_model_and_tokenizer
from mappa.policy.policy import Policy
from mappa.policy.sampling_copies import choose_dtype
from mappa.rollout import build_kit
from mappa.training.selftest import check_agents
from mappa.training.trainer import update_settings
from mappa.training.update import update_group

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]

T = 0.7
BF16 = torch.bfloat16


def _gap(policy: Policy, agent: str | None, seed: int = 2) -> float:
    """Mean |generate's log-probs - the forward pass's| over a batch sampled with `agent`."""
    gens = policy.generate(agent, convs(4), max_new_tokens=12, temperature=T, seed=seed)
    prompts, responses = [g.prompt_ids for g in gens], [g.response_ids for g in gens]
    with torch.no_grad():
        lp, mask = policy.forward_logprobs(agent, prompts, responses, temperature=T)
    reported = torch.zeros_like(lp)
    for i, g in enumerate(gens):
        reported[i, : len(g.logprobs)] = torch.tensor(g.logprobs)
    return float((reported - lp)[mask].abs().mean())


def test_the_dtype_follows_the_mode_the_device_and_the_update_precision() -> None:
    assert choose_dtype("off", "cpu", BF16, False) is None
    assert choose_dtype("auto", "cpu", BF16, False) is BF16  # the update already runs in bf16
    assert choose_dtype("auto", "cpu", None, False) is None  # a float32 update: sample through the adapters
    assert choose_dtype("float32", "cpu", None, False) is torch.float32
    assert choose_dtype("bfloat16", "cpu", None, False) is BF16
    assert choose_dtype("bfloat16", "cuda", BF16, False) is None  # a GPU: the server backend is the fast path
    assert choose_dtype("float32", "cpu", None, True) is None  # sharded weights are never copied whole
    with pytest.raises(ValueError, match="unknown mode 'fp8'"):
        choose_dtype("fp8", "cpu", None, False)


@pytest.mark.parametrize("mode", ["lora", "full", "shared"])
def test_float32_copies_sample_what_the_forward_pass_computes(mode: str) -> None:
    policy = make_policy(mode, eos_scale=5.0)
    for k, agent in enumerate(AGENTS if mode != "shared" else AGENTS[:1]):
        perturb(policy, agent, seed=k + 1)
    through_adapters = policy.generate("coder", convs(4), max_new_tokens=12, temperature=T, seed=5)
    policy.sample_from_copies(torch.float32)
    from_copies = policy.generate("coder", convs(4), max_new_tokens=12, temperature=T, seed=5)
    assert [g.response_ids for g in from_copies] == [g.response_ids for g in through_adapters]
    for agent in (*AGENTS, None):
        assert _gap(policy, agent) < 2e-3, agent
    # the agents differ from the base, so a copy holding the base (or another agent) would fail the gaps above
    assert _gap(policy, "coder") < 0.1 * abs(_gap_under(policy, "coder", None))


def _gap_under(policy: Policy, sampled: str, scored: str | None) -> float:
    """How far `scored`'s log-probs are from those of a batch `sampled` generated: the size of a wrong copy."""
    gens = policy.generate(sampled, convs(4), max_new_tokens=12, temperature=T, seed=2)
    prompts, responses = [g.prompt_ids for g in gens], [g.response_ids for g in gens]
    with torch.no_grad():
        a, mask = policy.forward_logprobs(sampled, prompts, responses, temperature=T)
        b, _ = policy.forward_logprobs(scored, prompts, responses, temperature=T)
    return float((a - b)[mask].abs().mean())


def test_a_copy_follows_an_update_and_is_only_refilled_when_its_weights_changed() -> None:
    policy = make_policy()
    perturb(policy, "solver", scale=0.3, seed=3)
    policy.sample_from_copies(torch.float32)
    actions = solver_actions(policy, 6, T)
    policy.generate("coder", convs(1), max_new_tokens=2, seed=0)
    filled = policy._sampling.refreshes
    policy.generate("solver", convs(1), max_new_tokens=2, seed=0)
    policy.generate("coder", convs(1), max_new_tokens=2, seed=0)
    assert policy._sampling.refreshes == filled  # nothing changed: the copies are reused

    cfg = Config()
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"mini_batch_size": 6})})
    prompts, responses = [a.prompt_ids for a in actions], [a.response_ids for a in actions]
    with torch.no_grad():
        old, mask = policy.forward_logprobs("solver", prompts, responses, temperature=T)
    opt = torch.optim.AdamW(policy.trainable_parameters("solver"), lr=0.05)
    update_group(policy, opt, actions, [10.0, 0.0, 5.0, 3.0, 8.0, 1.0], update_settings(cfg, policy.samples_exactly))
    with torch.no_grad():
        new, _ = policy.forward_logprobs("solver", prompts, responses, temperature=T)
    assert float((new - old)[mask].abs().mean()) > 0.05  # the step moved the weights: a stale copy would show
    assert _gap(policy, "solver") < 2e-3  # sampled from the updated weights
    assert policy._sampling.refreshes == filled + 1  # the solver's copy alone was refilled
    policy.generate("coder", convs(1), max_new_tokens=2, seed=0)
    assert policy._sampling.refreshes == filled + 1


def test_a_copy_follows_loaded_weights(tmp_path) -> None:  # noqa: ANN001
    trained = make_policy()
    perturb(trained, "verifier", seed=4)
    trained.save(tmp_path / "ckpt")
    policy = make_policy()
    policy.sample_from_copies(torch.float32)
    policy.generate("verifier", convs(1), max_new_tokens=2, seed=0)  # a copy of the untrained adapter
    policy.load_weights(tmp_path / "ckpt")
    assert _gap(policy, "verifier") < 2e-3


def test_bfloat16_copies_pass_the_self_test_and_a_stale_copy_fails_it(monkeypatch) -> None:  # noqa: ANN001
    policy = make_policy()
    policy.sample_from_copies(BF16)
    assert len(check_agents(policy, AGENTS, temperature=T)) == 3
    copies = [module for _, module in policy._sampling._copies.values()]
    assert copies and all(p.dtype == BF16 for m in copies for p in m.parameters())
    assert 0.0 < _gap(policy, "solver") < 0.25  # bf16 rounding, not another model's distribution

    stale = make_policy()
    stale.sample_from_copies(torch.float32)
    monkeypatch.setattr(sampling_copies, "fingerprint", lambda params: ())  # never sees a change
    for agent in AGENTS:  # copies of the untrained adapters (the base), kept through the self-test's perturbation
        stale.generate(agent, convs(1), max_new_tokens=2, seed=0)
    with pytest.raises(MappaError, match="generates with the base weights"):
        check_agents(stale, AGENTS, temperature=T)


def test_copies_can_be_switched_off_again() -> None:
    policy = make_policy()
    perturb(policy, "solver")
    policy.sample_from_copies(BF16)
    assert policy.sampling_dtype is BF16
    policy.sample_from_copies(None)
    assert policy.sampling_dtype is None and _gap(policy, "solver") < 2e-3


@pytest.mark.parametrize(("mode", "dtype"), [("float32", torch.float32), ("auto", None), ("off", None)])
def test_the_configured_mode_reaches_the_policy(mode: str, dtype: torch.dtype | None) -> None:
    """`generation.sampling_copy` through `build_kit` (the one constructor of a run's parts). The tiny model is
    narrower than `mappa.policy.precision.MIN_HIDDEN`, so its update is never autocast and `auto` stays off."""
    cfg = Config()
    cfg = cfg.model_copy(
        update={
            "model": cfg.model.model_copy(update={"name": "tiny-random"}),
            "generation": cfg.generation.model_copy(update={"sampling_copy": mode}),
        }
    )
    with build_kit(cfg, AGENTS, coach=False, sandbox=False) as kit:
        assert kit.policy.sampling_dtype is dtype


def test_a_run_sampling_from_bfloat16_copies_trains_and_resumes_exactly(tmp_path) -> None:  # noqa: ANN001
    """The trainer's whole path with bfloat16 copies on the tiny model (its update forced into bfloat16 too): the
    self-test passes, every agent trains, and a run resumed from its step-2 checkpoint ends where a straight run
    does (the copies are rebuilt from the loaded weights)."""
    from helpers import TINY, assert_updated_where_scores_differ

    from mappa.config import load_config
    from mappa.training.checkpoint import latest_checkpoint
    from mappa.training.tracking import read_metrics
    from mappa.training.trainer import train

    sets = [*TINY, "generation.sampling_copy=bfloat16", "train.cpu_autocast=bf16", "train.checkpoint_every=1"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(load_config(None, [*sets, "train.steps=3", f"run_dir={straight}"]), straight)
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000003")  # as if killed before step 3's checkpoint
    (resumed / "checkpoints" / "latest").write_text("step-000002")
    train(load_config(None, [*sets, "train.steps=3", f"run_dir={resumed}"]), resumed, resume=True)
    rows = [r for r in read_metrics(straight) if "time/rollout_s" in r]
    assert_updated_where_scores_differ(rows, ("problem_solver", "code_executor", "verifier"))
    a = Policy.from_checkpoint(latest_checkpoint(straight) / "policy", device="cpu")
    b = Policy.from_checkpoint(latest_checkpoint(resumed) / "policy", device="cpu")
    assert latest_checkpoint(resumed).name == "step-000003"
    for agent in a.agents:
        for p, q in zip(a.trainable_parameters(agent), b.trainable_parameters(agent), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_an_update_recomputes_what_a_bfloat16_copy_sampled(dtype: torch.dtype, monkeypatch) -> None:  # noqa: ANN001
    """The run's config does not decide it: the generator says whether its log-probs are the training forward
    pass's (`LocalGenerator.samples_exactly`: its policy's), and the update's one rule recomputes them when not.
    After bfloat16 sampling they are not, so the first step's ratio is 1; float32 copies are exact and are used as
    they are."""
    policy = make_policy()
    perturb(policy, "solver", scale=0.3, seed=3)
    policy.sample_from_copies(dtype)
    assert policy.samples_exactly is (dtype == torch.float32)
    actions = solver_actions(policy, 6, T)
    step = first_update_step(actions, T, recompute=False, policy=policy, exact=policy.samples_exactly)
    assert step["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and abs(step["approx_kl"]) < 1e-6
    if dtype == BF16:  # teeth: trusting the bfloat16 sampler's log-probs moves the ratio with no weight change
        monkeypatch.setattr(Policy, "samples_exactly", property(lambda self: True))
        trusted = first_update_step(actions, T, recompute=False, policy=policy, exact=policy.samples_exactly)
        assert abs(trusted["ratio_mean"] - 1.0) > 1e-4 or abs(trusted["approx_kl"]) > 1e-6


@pytest.mark.parametrize(("mode", "exact"), [("bfloat16", False), ("float32", True), ("off", True)])
def test_a_ray_rollout_worker_says_whether_its_logprobs_are_exact(mode: str, exact: bool, tmp_path) -> None:  # noqa: ANN001
    """What a Ray cluster asks each rollout worker once (`RolloutWorker.samples_exactly`, its generator's answer,
    in-process here): a worker sampling from bfloat16 copies has every trainer recompute the old log-probs
    (`mappa.training.update.recomputes_old_logprobs`), whatever the trainers' own hardware would choose."""
    from helpers import TINY

    from mappa.config import load_config
    from mappa.distributed.actors import RolloutWorker
    from mappa.training.trainer import update_settings
    from mappa.training.update import recomputes_old_logprobs

    cfg = load_config(None, [*TINY, f"generation.sampling_copy={mode}", f"run_dir={tmp_path}"])
    worker = RolloutWorker(cfg, AGENTS, str(tmp_path), "cpu", 1, cfg.generation.base_url)
    try:
        said = worker.samples_exactly()
    finally:
        worker.close()
    assert said is exact
    train = cfg.train.model_copy(update={"recompute_old_logprobs": False})
    settings = update_settings(cfg.model_copy(update={"train": train}), said)
    assert recomputes_old_logprobs(settings, None) is not exact  # what every trainer then does


def test_a_copy_folded_with_the_wrong_scale_fails_the_self_test(monkeypatch) -> None:  # noqa: ANN001
    """A bfloat16 copy is held to its own forward pass for the log-probs it reports, so that it holds the agent's
    weights is checked apart: a fold that doubles each adapter's delta reports its own log-probs faithfully and
    is still caught."""
    from mappa.policy import lora
    from mappa.policy import weights as agent_weights

    def doubled(target: torch.nn.Module, peft_model, adapter: str | None) -> None:  # noqa: ANN001
        lora.fold_adapter(target, peft_model, adapter)
        if adapter is not None:
            base = lora.plain_base(peft_model)
            with torch.no_grad():
                for w, b in zip(target.parameters(), base.parameters(), strict=True):
                    w.copy_(2 * w - b.to(w.dtype))  # base + 2 x delta

    policy = make_policy()
    policy.sample_from_copies(BF16)
    assert len(check_agents(policy, AGENTS, temperature=T)) == 3  # the right fold passes
    monkeypatch.setattr(agent_weights, "fold_adapter", doubled)
    wrong = make_policy()
    wrong.sample_from_copies(BF16)
    with pytest.raises(MappaError, match="'solver''s sampling copy does not hold its weights"):
        check_agents(wrong, AGENTS, temperature=T)


def test_bfloat16_copies_reporting_another_temperature_fail_the_self_test() -> None:
    from helpers import RawLogprobs

    policy = make_policy()
    policy.sample_from_copies(BF16)
    with pytest.raises(MappaError, match="temperature 0.7"):
        check_agents(RawLogprobs(policy), AGENTS, temperature=T)


def _qwen2_policy(mode: str) -> Policy:
    model, tokenizer = tiny_model_and_tokenizer(0, family="qwen2")
    return Policy.from_model(model, tokenizer, AGENTS, agent_weights=mode)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_copies_of_a_qwen2_shaped_model_hold_its_biases_and_its_own_lm_head(mode: str) -> None:
    """The Qwen2.5 models carry biases on q/k/v and an LM head untied from the embeddings: a copy that took the head
    from the embeddings, or lost or froze a bias, samples another model. In `full` mode both are trained weights,
    so a copy must also follow them."""
    policy = _qwen2_policy(mode)
    for k, agent in enumerate(AGENTS):
        perturb(policy, agent, scale=0.05 if mode == "full" else 0.5, seed=k + 1)
    policy.sample_from_copies(torch.float32)
    for agent in (*AGENTS, None):
        assert _gap(policy, agent) < 2e-3, agent
    with policy.sampler("coder") as copy, policy.active("coder") as own:
        assert copy.lm_head.weight.data_ptr() != copy.model.embed_tokens.weight.data_ptr()
        torch.testing.assert_close(copy.lm_head.weight, own.get_output_embeddings().weight, rtol=0, atol=0)
        biases = {n: p for n, p in copy.named_parameters() if n.endswith(".bias")}
        assert len(biases) == 6 and all(float(b.abs().mean()) > 0.1 for b in biases.values())
    policy.sample_from_copies(BF16)
    assert len(check_agents(policy, AGENTS, temperature=T)) == 3
    assert _gap(policy, "coder") < 0.25


@pytest.mark.slow  # the embedded model, ~1 min
@pytest.mark.parametrize("seed", [57, 61, 65])
def test_the_self_test_passes_bfloat16_copies_of_the_embedded_model(seed: int) -> None:
    """Seeds whose perturbed Verifier (57) or Code Executor (61, 65), folded into bfloat16, reports log-probs
    0.28-0.30 nats/token from the float32 forward pass: a self-test that held the copy to that forward refused these runs before their first
    step. Held to the copy's own forward (and the copy to the agent's weights), they pass."""
    from mappa.config import load_config

    cfg = load_config(None, [])
    policy = Policy.from_config(cfg.model, ["problem_solver", "code_executor", "verifier"], seed=seed)
    policy.sample_from_copies(BF16)
    assert len(check_agents(policy, policy.agents, temperature=0.7)) == 3


QWEN = "qwen2.5-coder-0.5b-instruct"


def _qwen_policy() -> Policy:
    from mappa.config import load_config
    from mappa.policy.models import packaged_model_path

    if not packaged_model_path(QWEN).is_file():
        pytest.skip(f"{QWEN} is not fetched (make models)")
    cfg = load_config(None, [f"model.name={QWEN}"])
    return Policy.from_config(cfg.model, ["problem_solver", "code_executor", "verifier"], seed=42)


@pytest.mark.slow  # ~6 GB, ~1 min
def test_bfloat16_copies_of_qwen2_5_coder_hold_the_agents_weights() -> None:
    """Biases on q/k/v and an LM head of its own: the copy's forward stays within bfloat16 rounding of the agent's
    float32 forward, far from the base, at a perturbation the size of a few updates (0.3-1 nats/token from the
    base). Measured: 0.02-0.03 nats/token at every size up to 1 nat/token, and at 64-1,536-token contexts."""
    from mappa.training.selftest import _perturb, _restore

    policy = _qwen_policy()
    agent = "code_executor"
    params = policy.trainable_parameters(agent)
    backups = _perturb(params, seed=0)
    with torch.no_grad():
        for p, b in zip(params, backups, strict=True):
            p.copy_(b + 0.25 * (p - b))  # the full perturbation wrecks this model (see the next test)
    policy.sample_from_copies(BF16)
    prompt = policy.chat_ids(convs(1)[0])
    response = prompt[-24:]
    with torch.no_grad():
        own, mask = policy.forward_logprobs(agent, [prompt], [response], temperature=T)
        base, _ = policy.forward_logprobs(None, [prompt], [response], temperature=T)
        copied, _ = policy.forward_logprobs(agent, [prompt], [response], temperature=T, sampler=True)
    _restore(params, backups)
    moved, gap = float((own - base)[mask].abs().mean()), float((copied - own)[mask].abs().mean())
    assert moved > 0.2 and gap < 0.1 and gap < moved / 4, (moved, gap)


@pytest.mark.slow
def test_the_self_test_passes_bfloat16_copies_of_qwen2_5_coder() -> None:
    # Its perturbation is shrunk until it moves the agent at most `selftest.MAX_MOVED` nats/token: noise the size of
    # the weights moves this model 9-14 and wrecks it, where any bfloat16 arithmetic is chaotic.
    policy = _qwen_policy()
    policy.sample_from_copies(BF16)
    assert len(check_agents(policy, policy.agents, temperature=0.7)) == 3
