"""bfloat16 autocast for the update's forward and backward passes on CPUs with native bfloat16 matmuls.

    dtype = autocast_dtype(train.cpu_autocast, policy.model)   # torch.bfloat16 or None
    with autocast(dtype):
        logp, mask = policy.forward_logprobs(...)

On a CPU with bfloat16 dot-product instructions (Intel AMX `amx_bf16`, or AVX-512 `avx512_bf16` as on AMD Zen 4)
oneDNN runs bfloat16 matmuls several times faster than float32 ones at training shapes (hundreds of rows); on
two cores of an AVX-512 BF16 CPU the update phase of a SmolLM2-135M-shaped model ran 1.6x as fast
(bench/bench_precision.py, docs/models.md). The weights stay float32 (master weights: AdamW updates them in
float32); autocast runs the matmuls in bfloat16 and casts the frozen weights anew in every forward pass. Small
matmuls gain nothing (the casts cost about what the product saves), so `auto` leaves models narrower than
`MIN_HIDDEN` in float32, and decoding (a handful of rows per step: 0.66x in bfloat16) is never autocast. CUDA
is left as it is: there the model itself is loaded in bfloat16 (`model.dtype`).

The ratio's reference must be computed in the same precision and layout as the training forward: the update
computes its old log-probs under the same autocast, in the training forward's own micro-batches
(`mappa.training.update`), so the first optimizer step's ratio is exactly 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

CPU_AUTOCAST = ("auto", "bf16", "off")
# below this hidden size the casts cost about what bfloat16 matmuls save (hidden 64: 1.0x, 256: 2x, on 2 cores)
MIN_HIDDEN = 256


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bfloat16 dot-product instructions (AMX tiles or AVX-512 BF16), as torch detects them."""
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()


def choose_dtype(
    mode: str, device_type: str, param_dtype: torch.dtype, hidden_size: int, native_bf16: bool
) -> torch.dtype | None:
    """The autocast dtype for `mode` (`train.cpu_autocast`), or None for none. Pure, so every case is testable:
    `bf16` forces it on a CPU, `off` never, `auto` only where it pays (a float32 model at least `MIN_HIDDEN` wide
    on a CPU with native bfloat16). Never on other devices, nor for a model already in a half dtype."""
    if mode not in CPU_AUTOCAST:
        raise ValueError(f"cpu_autocast: unknown mode {mode!r} (use {', '.join(CPU_AUTOCAST)})")
    if device_type != "cpu" or param_dtype != torch.float32 or mode == "off":
        return None
    if mode == "bf16" or (native_bf16 and hidden_size >= MIN_HIDDEN):
        return torch.bfloat16
    return None


def autocast_dtype(mode: str, model: torch.nn.Module) -> torch.dtype | None:
    """`choose_dtype` for `model` (a HF causal LM, maybe wrapped by peft) on this machine."""
    param = next(model.parameters())
    hidden = int(getattr(model.config, "hidden_size", 0))  # a config without one (not a HF LM): never `auto`
    native = param.device.type == "cpu" and cpu_has_native_bf16()
    return choose_dtype(mode, param.device.type, param.dtype, hidden, native)


@contextlib.contextmanager
def autocast(dtype: torch.dtype | None) -> Iterator[None]:
    """CPU autocast to `dtype` for the block; None: nothing changes."""
    if dtype is None:
        yield
        return
    with torch.autocast("cpu", dtype=dtype):
        yield
