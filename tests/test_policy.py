"""Policy layer on a tiny random Llama: batched generation, logprobs, per-agent weights, checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import AGENTS, convs, make_policy, perturb

from mappa.errors import MappaError
from mappa.policy import decoding
from mappa.policy.decoding import response_layout, token_logprobs
from mappa.policy.lora import adapter_names
from mappa.policy.models import tiny_model_and_tokenizer
from mappa.policy.policy import Generation, Policy
from mappa.policy.storage import read_manifest
from mappa.types import Message

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def logprobs_of(policy: Policy, agent: str | None, gens: list[Generation]) -> torch.Tensor:
    lp, _ = policy.sequence_logprobs(agent, [g.prompt_ids for g in gens], [g.response_ids for g in gens])
    return lp


# ------------------------------------------------------------------------------------------------------------------
# tokens and generation


def test_chat_ids_use_the_chat_template_and_end_with_the_assistant_prompt():
    policy = make_policy()
    msgs = [Message(role="system", content="sys"), Message(role="user", content="What is 2+2?")]
    ids = policy.chat_ids(msgs)
    text = policy.tokenizer.decode(ids)
    assert (
        text == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids[0] == policy.tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_generation_logprobs_match_forward_logprobs_for_each_agent_and_the_reference():
    # PPO's ratio pi/pi_old relies on this: the logprobs recorded at sampling time must be what the
    # training forward computes for the same tokens under the same weights.
    policy = make_policy(eos_scale=5.0)
    perturb(policy, "solver", seed=1)
    perturb(policy, "coder", seed=2)
    for agent in ("solver", "coder", "verifier", None):
        gens = policy.generate(agent, convs(6), max_new_tokens=24, temperature=1.3, top_p=0.9, seed=3, batch_size=4)
        lp, mask = policy.forward_logprobs(
            agent, [g.prompt_ids for g in gens], [g.response_ids for g in gens], temperature=1.3
        )
        for i, g in enumerate(gens):
            assert mask[i].sum().item() == len(g.response_ids) == len(g.logprobs)
            torch.testing.assert_close(lp[i, : len(g.logprobs)], torch.tensor(g.logprobs), atol=1e-4, rtol=0)
            assert (lp[i, len(g.logprobs) :] == 0).all()


def test_batched_greedy_equals_one_at_a_time():
    # Left padding, position ids and dropping finished rows from the KV cache must not change results.
    policy = make_policy(eos_scale=1.6)
    perturb(policy, "coder", scale=1.0)
    batch = policy.generate("coder", convs(7), temperature=0.0, max_new_tokens=20)
    single = [policy.generate("coder", [c], temperature=0.0, max_new_tokens=20)[0] for c in convs(7)]
    assert [g.response_ids for g in batch] == [g.response_ids for g in single]
    assert {g.truncated for g in batch} == {True, False}, "want both early-stopped and truncated rows"
    for b, s in zip(batch, single, strict=True):
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(s.logprobs), atol=1e-4, rtol=0)


def test_generation_stops_at_eos_per_sequence_and_flags_truncation():
    policy = make_policy(eos_scale=5.0)
    eos = set(policy.eos_ids)
    gens = policy.generate("solver", convs(16), max_new_tokens=30, seed=0)
    assert len(gens) == 16
    finished = [g for g in gens if not g.truncated]
    truncated = [g for g in gens if g.truncated]
    assert finished and truncated
    for g in finished:
        assert g.response_ids[-1] in eos and not eos & set(g.response_ids[:-1])
        assert len(g.response_ids) <= 30
        assert "<|im_end|>" not in g.text
    for g in truncated:
        assert len(g.response_ids) == 30 and not eos & set(g.response_ids)
    assert all(g.text == policy.tokenizer.decode(g.response_ids, skip_special_tokens=True) for g in gens)


def test_results_come_back_in_input_order_with_their_prompts():
    policy = make_policy()
    cs = convs(5)[::-1]  # longest first, so sorting by length reorders internally
    gens = policy.generate("solver", cs, max_new_tokens=4, seed=0, batch_size=2)
    assert [list(g.prompt_ids) for g in gens] == [policy.chat_ids(c) for c in cs]


def test_seed_makes_sampling_reproducible_and_leaves_the_global_rng_alone():
    policy = make_policy()
    state = torch.random.get_rng_state()
    a = policy.generate("solver", convs(4), max_new_tokens=12, seed=7)
    assert torch.equal(state, torch.random.get_rng_state())
    b = policy.generate("solver", convs(4), max_new_tokens=12, seed=7)
    c = policy.generate("solver", convs(4), max_new_tokens=12, seed=8)
    assert [g.response_ids for g in a] == [g.response_ids for g in b]
    assert [g.response_ids for g in a] != [g.response_ids for g in c]


def test_a_seeded_conversation_samples_the_same_whatever_else_is_in_the_call():
    """One episode's change (a different prompt, an extra or a missing row) must not move another's draws."""
    policy = make_policy()
    a, others = convs(6)[0], convs(6)[1:]
    kw = {"max_new_tokens": 12, "temperature": 1.0, "batch_size": 8}
    alone = policy.generate("solver", [a], seed=[11], **kw)[0]
    with_two = policy.generate("solver", [others[0], a, others[2]], seed=[5, 11, 6], **kw)[1]
    with_four = policy.generate("solver", [*others[1:], a], seed=[1, 2, 3, 4, 11], **kw)[4]
    assert alone.response_ids == with_two.response_ids == with_four.response_ids
    other_seed = policy.generate("solver", [a], seed=[12], **kw)[0]
    assert other_seed.response_ids != alone.response_ids  # the row's own seed decides its draws
    # one seed for the call: rows draw from distinct streams by position, so equal prompts differ
    twins = policy.generate("solver", [a, a, a], seed=7, **kw)
    assert len({g.response_ids for g in twins}) == 3
    with pytest.raises(ValueError, match="3 rows but 2 seeds"):
        policy.generate("solver", [a, a, a], seed=[1, 2], **kw)


def test_inverse_cdf_gives_each_index_its_share_and_never_a_zero():
    probs = torch.tensor([[0.0, 1.0, 0.0, 0.5, 0.5]])  # any total: shares 1/2, 1/4, 1/4
    u = torch.arange(10_000, dtype=torch.float64) / 10_000  # evenly spread over [0, 1), 0 included
    picks = decoding.inverse_cdf(probs.expand(10_000, -1), u)
    assert torch.bincount(picks, minlength=5).tolist() == [0, 5000, 0, 2500, 2500]
    assert decoding.inverse_cdf(probs, torch.tensor([1 - 2**-53], dtype=torch.float64)).item() == 4


def test_sampling_draws_the_tempered_distribution_within_top_p():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n, temperature = 20_000, 0.7
    rows = [decoding.DecodeRow(i, [1], 1) for i in range(n)]
    gen = torch.Generator().manual_seed(0)
    picks = decoding._sample(logits.expand(n, -1), temperature, 1.0, gen, rows)
    want = torch.softmax(logits / temperature, -1)
    got = torch.bincount(picks, minlength=6) / n
    assert ((got - want).abs() <= 4 * (want * (1 - want) / n).sqrt() + 1e-4).all(), (got, want)
    nucleus = decoding._sample(logits.expand(n, -1), temperature, 0.8, gen, rows)
    kept = int((want.cumsum(0) - want < 0.8).sum())  # tokens whose preceding mass is below top_p
    assert set(nucleus.tolist()) == set(range(kept)) and kept < 6


def test_tiny_top_p_is_greedy_and_top_logprobs_are_sorted():
    policy = make_policy()
    greedy = policy.generate("solver", convs(3), temperature=0.0, max_new_tokens=8)
    nucleus = policy.generate(
        "solver", convs(3), temperature=1.0, top_p=1e-6, max_new_tokens=8, seed=0, top_logprobs=3
    )
    assert [g.response_ids for g in greedy] == [g.response_ids for g in nucleus]
    for g in nucleus:
        assert len(g.top_logprobs) == len(g.response_ids)
        for (tok, lp), top in zip(zip(g.response_ids, g.logprobs, strict=True), g.top_logprobs, strict=True):
            values = [v for _, v in top]
            assert len(top) == 3 and values == sorted(values, reverse=True)
            assert top[0] == (tok, pytest.approx(lp, abs=1e-6))  # greedy picks the argmax
    assert greedy[0].top_logprobs is None


def test_prompt_over_max_context_tokens_is_an_error_naming_agent_and_length():
    policy = make_policy()
    n = len(policy.chat_ids(convs(1)[0]))
    with pytest.raises(MappaError, match=rf"agent coder: prompt 0 has {n} tokens.*max_context_tokens={n - 1}"):
        policy.generate("coder", convs(1), max_context_tokens=n - 1)
    assert policy.generate("coder", convs(1), max_context_tokens=n, max_new_tokens=2)[0].prompt_ids


def test_unknown_agent_is_an_error():
    policy = make_policy()
    with pytest.raises(MappaError, match="unknown agent 'planner'"):
        policy.generate("planner", convs(1))
    with pytest.raises(MappaError, match="unknown agent"):
        policy.trainable_parameters("planner")


# ------------------------------------------------------------------------------------------------------------------
# one set of weights per agent


def test_perturbing_one_adapter_changes_only_that_agent():
    policy = make_policy()
    gens = policy.generate(None, convs(4), max_new_tokens=10, seed=0)
    before = {a: logprobs_of(policy, a, gens) for a in (*AGENTS, None)}
    # standard LoRA init (B = 0): every agent starts equal to the reference
    for a in AGENTS:
        torch.testing.assert_close(before[a], before[None])
    greedy_before = {a: policy.generate(a, convs(4), temperature=0, max_new_tokens=10) for a in AGENTS}

    perturb(policy, "coder", scale=1.0)
    after = {a: logprobs_of(policy, a, gens) for a in ("solver", "verifier", None, "coder")}
    assert (after["coder"] - before["coder"]).abs().max() > 1e-2
    for a in ("solver", "verifier", None):
        torch.testing.assert_close(after[a], before[a], atol=0, rtol=0)
    # switching back and forth between agents keeps using the named agent's weights
    for a in ("coder", "solver", "coder", None, "verifier"):
        torch.testing.assert_close(logprobs_of(policy, a, gens), after[a], atol=0, rtol=0)
    greedy_after = {a: policy.generate(a, convs(4), temperature=0, max_new_tokens=10) for a in AGENTS}
    for a in ("solver", "verifier"):
        assert [g.response_ids for g in greedy_after[a]] == [g.response_ids for g in greedy_before[a]]
    assert [g.response_ids for g in greedy_after["coder"]] != [g.response_ids for g in greedy_before["coder"]]


def test_concurrent_callers_each_get_their_own_agent():
    # Coach servers and rollouts may call from several threads; a switch must never leak into another call.
    from concurrent.futures import ThreadPoolExecutor

    policy = make_policy()
    perturb(policy, "solver", seed=1)
    perturb(policy, "coder", seed=2)
    gens = policy.generate(None, convs(3), max_new_tokens=8, seed=0)
    expected = {a: logprobs_of(policy, a, gens) for a in (*AGENTS, None)}
    jobs = [a for _ in range(6) for a in (*AGENTS, None)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda a: logprobs_of(policy, a, gens), jobs))
    for agent, lp in zip(jobs, results, strict=True):
        torch.testing.assert_close(lp, expected[agent], atol=0, rtol=0)


def test_trainable_parameters_are_disjoint_and_only_the_named_agent_gets_gradients():
    policy = make_policy()
    params = {a: policy.trainable_parameters(a) for a in AGENTS}
    ids = {a: {id(p) for p in ps} for a, ps in params.items()}
    assert all(len(ps) == 2 * 7 * 2 for ps in params.values())  # A and B for 7 modules x 2 layers
    assert not ids["solver"] & ids["coder"] and not ids["coder"] & ids["verifier"]
    base = [p for n, p in policy.model.named_parameters() if ".lora_" not in n]
    assert base and not any(p.requires_grad for p in base)

    gens = policy.generate("solver", convs(3), max_new_tokens=6, seed=0)
    prompts, responses = [g.prompt_ids for g in gens], [g.response_ids for g in gens]
    # build an optimizer per agent up front, as the trainer does, then run the agents in turn
    opts = {a: torch.optim.AdamW(params[a], lr=1e-2) for a in AGENTS}
    coder_before = logprobs_of(policy, "coder", gens)
    ref_before = logprobs_of(policy, None, gens)  # peft's disable_adapter re-freezes adapters on exit
    for a in AGENTS:
        assert all(p.requires_grad for p in params[a]), f"{a}'s params were frozen by an adapter switch"
    lp, mask = policy.forward_logprobs("solver", prompts, responses)
    assert lp.requires_grad
    (-(lp * mask).sum() / mask.sum()).backward()
    assert all(p.grad is not None for p in params["solver"])
    assert all(p.grad is None for a in ("coder", "verifier") for p in params[a])
    for opt in opts.values():
        opt.step()
    assert (logprobs_of(policy, "solver", gens) - ref_before).abs().max() > 1e-4
    torch.testing.assert_close(logprobs_of(policy, "coder", gens), coder_before, atol=0, rtol=0)
    torch.testing.assert_close(logprobs_of(policy, None, gens), ref_before, atol=0, rtol=0)


def test_reference_logprobs_build_no_graph():
    policy = make_policy()
    gens = policy.generate("solver", convs(2), max_new_tokens=4, seed=0)
    lp, _ = policy.forward_logprobs(None, [g.prompt_ids for g in gens], [g.response_ids for g in gens])
    assert not lp.requires_grad


def test_shared_mode_uses_one_adapter_for_every_agent():
    policy = make_policy("shared")
    assert {id(p) for p in policy.trainable_parameters("solver")} == {
        id(p) for p in policy.trainable_parameters("verifier")
    }
    perturb(policy, "solver")
    gens = policy.generate("solver", convs(3), max_new_tokens=8, seed=0)
    torch.testing.assert_close(logprobs_of(policy, "verifier", gens), logprobs_of(policy, "solver", gens))
    assert (logprobs_of(policy, None, gens) - logprobs_of(policy, "solver", gens)).abs().max() > 1e-2


def test_full_mode_trains_a_separate_copy_per_agent_and_keeps_the_reference():
    policy = make_policy("full")
    params = {a: policy.trainable_parameters(a) for a in AGENTS}
    n_base = sum(p.numel() for p in policy.model.parameters())
    assert sum(p.numel() for p in params["coder"]) == n_base
    assert not {id(p) for p in params["coder"]} & {id(p) for p in params["solver"]}
    assert not any(p.requires_grad for p in policy.model.parameters())
    gens = policy.generate("coder", convs(3), max_new_tokens=8, seed=0)
    before = {a: logprobs_of(policy, a, gens) for a in (*AGENTS, None)}
    opt = torch.optim.AdamW(params["coder"], lr=1e-2)
    lp, mask = policy.forward_logprobs("coder", [g.prompt_ids for g in gens], [g.response_ids for g in gens])
    (-(lp * mask).sum()).backward()
    opt.step()
    assert (logprobs_of(policy, "coder", gens) - before["coder"]).abs().max() > 1e-4
    for a in ("solver", "verifier", None):
        torch.testing.assert_close(logprobs_of(policy, a, gens), before[a], atol=0, rtol=0)


def test_sequence_logprobs_match_forward_logprobs_in_input_order():
    policy = make_policy()
    perturb(policy, "verifier")
    gens = policy.generate("verifier", convs(7), max_new_tokens=9, seed=0)
    prompts = [g.prompt_ids for g in gens]
    responses = [g.response_ids[: 2 + i] for i, g in enumerate(gens)]  # ragged lengths
    lp, mask = policy.sequence_logprobs("verifier", prompts, responses, micro_batch_size=3)
    assert lp.shape == mask.shape == (7, max(len(r) for r in responses))
    assert not lp.requires_grad
    for i in range(7):
        one, m = policy.forward_logprobs("verifier", [prompts[i]], [responses[i]])
        assert mask[i].sum() == len(responses[i])
        torch.testing.assert_close(lp[i, : len(responses[i])], one[0, : len(responses[i])].detach(), atol=1e-5, rtol=0)


def test_empty_responses_give_empty_masks():
    policy = make_policy()
    lp, mask = policy.forward_logprobs("solver", [[1, 2, 3]], [[]])
    assert lp.shape == (1, 0) and mask.shape == (1, 0)
    lp, mask = policy.forward_logprobs("solver", [[1, 2, 3], [4, 5]], [[], [6, 7]])
    assert mask.tolist() == [[False, False], [True, True]]
    assert lp[0].abs().sum() == 0


def test_gradient_checkpointing_gives_the_same_gradients():
    grads = []
    for checkpointing in (False, True):
        policy = make_policy()
        perturb(policy, "coder")
        if checkpointing:
            policy.enable_gradient_checkpointing()
        lp, mask = policy.forward_logprobs("coder", [[1, 5, 9, 11], [3, 4]], [[20, 30, 40], [50, 60]])
        (lp * mask).sum().backward()
        grads.append([p.grad.clone() for p in policy.trainable_parameters("coder")])
        assert not policy.model.training
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------------------------------------------
# checkpoints


@pytest.mark.parametrize("mode", ["lora", "shared", "full"])
def test_save_and_from_checkpoint_round_trip(tmp_path, mode):
    policy = make_policy(mode, lora_r=4, lora_alpha=8)
    perturb(policy, "solver", seed=1)
    if mode != "shared":
        perturb(policy, "coder", seed=2)
    gens = policy.generate("solver", convs(3), max_new_tokens=8, seed=0)
    expected = {a: logprobs_of(policy, a, gens) for a in (*AGENTS, None)}
    policy.save(tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / "mappa_policy.json").read_text())
    assert manifest["agents"] == list(AGENTS) and manifest["agent_weights"] == mode
    assert manifest["lora"]["r"] == 4

    loaded = Policy.from_checkpoint(tmp_path / "ckpt", device="cpu")
    assert loaded.agents == AGENTS and loaded.agent_weights == mode
    for a in (*AGENTS, None):
        torch.testing.assert_close(logprobs_of(loaded, a, gens), expected[a], atol=1e-6, rtol=0)
    assert loaded.generate("coder", convs(2), temperature=0, max_new_tokens=6)[0].response_ids == (
        policy.generate("coder", convs(2), temperature=0, max_new_tokens=6)[0].response_ids
    )

    fresh = make_policy(mode, lora_r=4, lora_alpha=8)
    fresh.load_weights(tmp_path / "ckpt")
    for a in AGENTS:
        torch.testing.assert_close(logprobs_of(fresh, a, gens), expected[a], atol=1e-6, rtol=0)


def test_lora_adapters_are_saved_in_peft_format(tmp_path):
    policy = make_policy()
    policy.save(tmp_path)
    for agent in AGENTS:
        adapter_dir = tmp_path / "adapters" / f"agent_{agent}"
        assert (adapter_dir / "adapter_model.safetensors").is_file()
        assert json.loads((adapter_dir / "adapter_config.json").read_text())["r"] == 8


def test_load_weights_rejects_a_checkpoint_of_other_agents_or_rank(tmp_path):
    make_policy().save(tmp_path / "a")
    other = Policy.from_model(*tiny_model_and_tokenizer(0), ["solver", "coder"])
    with pytest.raises(MappaError, match="checkpoint has agents"):
        other.load_weights(tmp_path / "a")
    with pytest.raises(MappaError, match="adapter does not fit"):
        make_policy(lora_r=2).load_weights(tmp_path / "a")
    with pytest.raises(MappaError, match="not a mappa policy checkpoint"):
        Policy.from_checkpoint(tmp_path / "missing")
    (tmp_path / "a" / "adapters" / "agent_coder" / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(MappaError, match="unreadable weights"):
        make_policy().load_weights(tmp_path / "a")


def test_manifest_is_what_the_policy_reports_and_bad_ones_name_the_file(tmp_path):
    policy = make_policy("shared", lora_r=4)
    policy.save(tmp_path / "ok")
    assert read_manifest(tmp_path / "ok") == {"format_version": 2, **policy.manifest()}  # 2: teams (mappa.policy.team)
    assert policy.manifest()["adapters"] == dict.fromkeys(AGENTS, "shared")
    path = tmp_path / "bad" / "mappa_policy.json"
    path.parent.mkdir()
    path.write_text('{\n  "agents": [\n}')
    with pytest.raises(MappaError, match=r"bad/mappa_policy.json:3: invalid JSON"):
        read_manifest(path.parent)
    path.write_text(json.dumps({"agents": ["a"], "agent_weights": "lora", "base_name": None}))
    with pytest.raises(MappaError, match="missing field 'lora'"):
        Policy.from_checkpoint(path.parent)


def test_adapter_names_are_safe_peft_keys_and_distinct():
    names = adapter_names(["a.b", "a_b", "lora"])
    assert names == {"a.b": "agent_a_b", "a_b": "agent_a_b_1", "lora": "agent_lora"}
    assert adapter_names(["x", "y"], shared=True) == {"x": "shared", "y": "shared"}


def test_response_layout_starts_every_response_at_one_column():
    ids, attn, pos, mask = response_layout([[1, 2, 3], [4]], [[5], [6, 7]], pad_id=0, device=torch.device("cpu"))
    assert ids.tolist() == [[1, 2, 3, 5, 0], [0, 0, 4, 6, 7]]
    assert attn.tolist() == [[1, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert pos.tolist() == [[0, 1, 2, 3, 3], [0, 0, 0, 1, 2]]
    assert mask.tolist() == [[True, False], [True, True]]


def test_token_logprobs_are_those_of_the_tempered_distribution():
    logits, targets = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0)), torch.tensor([[1, 2, 3]] * 2)
    dist = torch.distributions.Categorical(logits=logits / 0.7)
    logp, ent = token_logprobs(logits, targets, 0.7, entropy=True)
    torch.testing.assert_close(logp, dist.log_prob(targets))
    torch.testing.assert_close(ent, dist.entropy())
    assert token_logprobs(logits, targets, 1.0)[1] is None


def test_constructor_errors():
    model, tok = tiny_model_and_tokenizer(0)
    with pytest.raises(MappaError, match="duplicate agent"):
        Policy.from_model(model, tok, ["a", "a"])
    with pytest.raises(MappaError, match="unknown mode"):
        Policy.from_model(model, tok, ["a"], agent_weights="experts")
    with pytest.raises(MappaError, match="lora_target_modules"):
        Policy.from_model(model, tok, ["a"], target_modules=["no_such_proj"])


def test_the_training_path_does_not_import_the_serving_package():
    """Continuous batching, buffered KV layers and the HTTP server live in mappa.serving, outside training."""
    import subprocess
    import sys

    code = (
        "import sys, mappa.policy.policy, mappa.training.trainer, mappa.rollout, mappa.training.evaluate\n"
        "import mappa.workflows, mappa.coach\n"
        "print(sorted(m for m in sys.modules if m.startswith(('mappa.serving', 'fastapi', 'uvicorn'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
