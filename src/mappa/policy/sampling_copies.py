"""Sampling copies: one plain module per agent, its trained weights folded into the base, for `Policy.generate`.

A decode step on a CPU is bound by reading the weights: every token of every row reads all of them once, and a
LoRA adapter adds its own small matmuls to each of the seven projections of every layer. A copy with the adapter
folded in (W + scale * B @ A) reads one matrix per projection, and a bfloat16 copy reads half the bytes. Measured
on two cores of an AVX-512 BF16 CPU, SmolLM2-135M with three rank-16 adapters, 110-token prompts, 48 new tokens,
`OMP_WAIT_POLICY=PASSIVE` as mappa runs (`bench/bench_sampling.py`; docs/models.md):

| rows | adapters, float32 | folded, float32 | folded, bfloat16 |
|---|---|---|---|
| 4 | 1.0x | 1.77x | 2.52x |
| 8 | 1.0x | 1.82x | 2.30x |
| 32 | 1.0x | 1.54x | 2.45x |

A float32 copy samples the distribution the forward pass computes (log-probs equal to float32 rounding). A
bfloat16 copy samples a slightly different one: about 0.002 nats/token KL from the update's bfloat16-autocast
forward, the same order as between float32 sampling and that forward (0.001). The ratio stays exact either way,
because the update recomputes the old log-probs in its own precision whenever sampling or training runs in
bfloat16 (`mappa.training.update`). The KL to the sampler is what TRL and verl also leave between vLLM and the trainer.

A copy is refreshed before the first generation after its agent's weights changed, detected from the trainable
tensors' storage and version counters (every in-place write bumps them: optimizer steps, `load_state_dict`, the
self-test's perturbation). Fused optimizers write without bumping them; `mappa.training.update` never builds one.

`choose_dtype` decides (`generation.sampling_copy`): `auto` folds into bfloat16 where the update already runs under
bfloat16 autocast (`mappa.policy.precision`), else samples through the adapters. Never on a GPU (a generation server
is the fast path there) nor for sharded weights. Each copy costs the base's size in its dtype.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable, Sequence

import torch

SAMPLING_COPY = ("auto", "off", "float32", "bfloat16")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# What identifies the state of a set of weights: (storage address, in-place version) of each tensor.
Fingerprint = tuple[tuple[int, int], ...]


def choose_dtype(mode: str, device_type: str, autocast: torch.dtype | None, sharded: bool) -> torch.dtype | None:
    """The copies' dtype for `mode`, or None to sample through the training modules. `autocast`: the update's
    CPU autocast dtype (`mappa.policy.precision.autocast_dtype`). Pure, so every case is testable."""
    if mode not in SAMPLING_COPY:
        raise ValueError(f"sampling_copy: unknown mode {mode!r} (use {', '.join(SAMPLING_COPY)})")
    if mode == "off" or device_type != "cpu" or sharded:
        return None
    if mode == "auto":
        return torch.bfloat16 if autocast == torch.bfloat16 else None
    return _DTYPES[mode]


def fingerprint(params: Sequence[torch.Tensor]) -> Fingerprint:
    """Changes whenever any of `params` is written in place or replaced."""
    return tuple((p.data_ptr(), p._version) for p in params)


class SamplingCopies:
    """Plain modules in `dtype`, one per key (an agent's weights, or the reference), each filled anew by `fill` when
    the fingerprint of the weights it was filled from changes. `template`: the base without adapters, a copy this
    object may take (it becomes the first key's module; later keys copy a filled one, since `fill` writes every
    weight that differs between keys)."""

    def __init__(self, template: torch.nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._template: torch.nn.Module | None = template.to(dtype).eval().requires_grad_(False)
        self._copies: dict[Hashable, tuple[Fingerprint, torch.nn.Module]] = {}
        self.refreshes = 0  # fills so far (the tests count them)

    @torch.no_grad()
    def get(self, key: Hashable, current: Fingerprint, fill: Callable[[torch.nn.Module], None]) -> torch.nn.Module:
        """The copy for `key`, filled anew when `current` differs from the fingerprint it was filled at."""
        held = self._copies.get(key)
        if held is not None and held[0] == current:
            return held[1]
        if held is not None:
            module = held[1]
        elif self._template is not None:
            module, self._template = self._template, None
        else:
            module = copy.deepcopy(next(iter(self._copies.values()))[1])
        fill(module)
        self.refreshes += 1
        self._copies[key] = (current, module)
        return module


@torch.no_grad()
def copy_weights(target: torch.nn.Module, source: torch.nn.Module) -> None:
    """Write every parameter and buffer of `source` into `target` (same architecture), cast to `target`'s dtype."""
    target.load_state_dict(source.state_dict())
