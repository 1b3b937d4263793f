"""CPU bfloat16 autocast (`mappa.policy.precision`): when it is chosen, that the update really runs its forward passes
in it, that PPO's ratio stays exactly 1 at the first optimizer step (old log-probs in the training forward's
precision and micro-batch layout, even when the config says to reuse the generation-time ones), and that LoRA
weights still learn."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import update_policy

from mappa.config import Config
from mappa.policy import precision
from mappa.training.update import UpdateSettings, update_group
from mappa.types import Action, Message

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BF16, F32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize(
    ("mode", "device", "param", "hidden", "native", "want"),
    [
        ("auto", "cpu", F32, 576, True, BF16),  # SmolLM2-135M on AMX / AVX-512 BF16
        ("auto", "cpu", F32, 576, False, None),  # no bfloat16 instructions: emulated, slower
        ("auto", "cpu", F32, 64, True, None),  # too narrow to pay for the casts
        ("bf16", "cpu", F32, 64, False, BF16),  # forced
        ("off", "cpu", F32, 4096, True, None),
        ("bf16", "cuda", F32, 576, True, None),  # CUDA paths are left alone
        ("auto", "cuda", BF16, 576, True, None),
        ("bf16", "cpu", BF16, 576, True, None),  # a bfloat16 model has nothing to autocast
    ],
)
def test_the_dtype_is_chosen_only_where_it_pays(
    mode: str, device: str, param: torch.dtype, hidden: int, native: bool, want: torch.dtype | None
) -> None:
    assert precision.choose_dtype(mode, device, param, hidden, native) == want


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="fp8"):
        precision.choose_dtype("fp8", "cpu", F32, 576, True)


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads the Linux CPU flags")
def test_detection_agrees_with_the_cpu_flags() -> None:
    flags = set(Path("/proc/cpuinfo").read_text().split())
    assert precision.cpu_has_native_bf16() == bool(flags & {"amx_bf16", "avx512_bf16"})


def test_the_tiny_model_stays_float32_under_auto() -> None:
    model = update_policy().model
    assert precision.autocast_dtype("auto", model) is None
    assert precision.autocast_dtype("off", model) is None
    assert precision.autocast_dtype("bf16", model) == BF16


def test_a_bad_config_value_is_a_one_line_error() -> None:
    """Through the CLI: one line naming the key and the allowed values, no traceback, a non-zero exit."""
    mappa = Path(sys.executable).with_name("mappa")
    proc = subprocess.run([mappa, "config", "show", "--set", "train.cpu_autocast=fp16"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.cpu_autocast" in lines[0] and "'auto', 'bf16' or 'off'" in lines[0], lines


def ragged_actions(n: int) -> list[Action]:
    """Random-token actions of ragged lengths (prompts 40-48 tokens, responses 16-31), long enough that a row's
    bfloat16 log-probs move with its micro-batch's padded length; their generation-time log-probs are wrong
    (all -1), so reused as they are, the ratio leaves 1 at once."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        prompt, response = 40 + (i * 3) % 9, 16 + (i * 5) % 16
        ids = torch.randint(5, 200, (prompt + response,), generator=gen).tolist()
        out.append(
            Action(agent="solver", turn=0, messages=(Message(role="user", content="x"),), text="",
                   prompt_ids=tuple(ids[:prompt]), response_ids=tuple(ids[prompt:]), logprobs=(-1.0,) * response)
        )  # fmt: skip
    return out


def run_update(mode: str, actions: list[Action]) -> tuple[list[dict[str, float]], set[torch.dtype], bool]:
    """Two mini-batches of update (recompute_old_logprobs off): each step's stats, the dtypes a LoRA-wrapped
    projection's output had in every forward, and whether the agent's weights changed."""
    policy = update_policy()
    params = policy.trainable_parameters("solver")
    before = [p.detach().clone() for p in params]
    update = {"mini_batch_size": len(actions) // 2, "micro_batch_size": 2, "recompute_old_logprobs": False}
    train = Config().train.model_copy(update={**update, "cpu_autocast": mode})
    settings = UpdateSettings(train, 1.0, 0.1, samples_exactly=True)
    seen: set[torch.dtype] = set()
    q_proj = policy.model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj")
    hook = q_proj.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
    steps: list[dict[str, float]] = []
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    try:
        update_group(policy, optimizer, actions, [9.0, 1.0, 6.0, 3.0, 10.0, 0.0], settings, on_step=steps.append)
    finally:
        hook.remove()
    moved = any(not torch.equal(b, p.detach()) for b, p in zip(before, params, strict=True))
    return steps, seen, moved


def test_under_autocast_the_first_ratio_is_exactly_one_and_lora_learns() -> None:
    actions = ragged_actions(6)
    steps, seen, moved = run_update("bf16", actions)
    assert seen == {BF16}  # every forward (reference, old, training) ran its matmuls in bfloat16
    assert len(steps) == 2
    assert abs(steps[0]["ratio_mean"] - 1.0) < 1e-6 and steps[0]["clip_frac"] == 0.0
    assert all(torch.isfinite(torch.tensor([s["loss"], s["grad_norm"]])).all() for s in steps)
    assert steps[0]["grad_norm"] > 0 and moved
    assert steps[1]["ratio_mean"] != 1.0  # the second mini-batch sees the weights after one step


def test_without_autocast_the_config_decides_as_before() -> None:
    """off: float32 throughout, and the generation-time log-probs are the reference, so the noise trips the clip."""
    steps, seen, moved = run_update("off", ragged_actions(6))
    assert seen == {F32} and moved
    assert steps[0]["clip_frac"] > 0
