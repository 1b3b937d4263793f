"""A KV-cache layer with room reserved for the tokens still to come, and the helpers that pad rows into it.

Used by `mappa.policy.decoding` (a policy's batched generation) and by `mappa.serving` (continuous batching).

This module subclasses transformers' `DynamicLayer` and replaces `DynamicCache.layers`, which are not
a stable public API: it is written against transformers==5.23.0 (the pin in requirements.lock), and
tests/test_decoder.py checks the methods it relies on, so an upgrade that changes them fails there first.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer


class BufferedLayer(DynamicLayer):
    """A dynamic KV-cache layer with room reserved for the tokens still to come.

    transformers' DynamicLayer concatenates the whole cache with each new token, copying it at every
    decode step (45% of a batch-of-8 decode step on ~1,600-token prompts); here a step writes one
    column in place. `keys`/`values` are views of the filled part, so everything that reads a
    DynamicLayer works unchanged.

    Built from blocks of rows, (keys (b, H, l, D), values): each block is right-aligned in `width`
    columns with zeros before it (masked out, but finite: 0 x NaN would poison attention), and is
    copied once, straight into place.
    """

    def __init__(self, blocks: list[tuple[torch.Tensor, torch.Tensor]], width: int, spare: int) -> None:
        super().__init__()
        self.lazy_initialization(*blocks[0])
        self._fill(blocks, width, spare)

    @classmethod
    def over(cls, keys: torch.Tensor, values: torch.Tensor, filled: int) -> BufferedLayer:
        """A layer over (B, H, width, D) buffers whose first `filled` columns hold the cache; the rest is room."""
        layer = cls.__new__(cls)
        DynamicLayer.__init__(layer)
        layer.lazy_initialization(keys, values)
        layer._k, layer._v, layer._n = keys, values, filled
        layer.keys, layer.values = keys[:, :, :filled], values[:, :, :filled]
        return layer

    def _fill(self, blocks: list[tuple[torch.Tensor, torch.Tensor]], width: int, spare: int) -> None:
        k0, v0 = blocks[0]
        rows = sum(k.shape[0] for k, _ in blocks)
        self._k = k0.new_empty(rows, k0.shape[1], width + spare, k0.shape[3])
        self._v = v0.new_empty(rows, v0.shape[1], width + spare, v0.shape[3])
        r = 0
        for k, v in blocks:
            b, pad = k.shape[0], width - k.shape[2]
            if pad:
                self._k[r : r + b, :, :pad].zero_()
                self._v[r : r + b, :, :pad].zero_()
            self._k[r : r + b, :, pad:width] = k
            self._v[r : r + b, :, pad:width] = v
            r += b
        self._n = width
        self.keys, self.values = self._k[:, :, :width], self._v[:, :, :width]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q = key_states.shape[2]
        if self._n + q > self._k.shape[2]:  # more tokens than reserved: grow, doubling
            self._fill([(self.keys, self.values)], self._n, max(q, self._k.shape[2]))
        self._k[:, :, self._n : self._n + q] = key_states
        self._v[:, :, self._n : self._n + q] = value_states
        self._n += q
        self.keys, self.values = self._k[:, :, : self._n], self._v[:, :, : self._n]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._fill([(self.keys[indices], self.values[indices])], self._n, self._k.shape[2] - self._n)


def stitchable(cache: Any) -> bool:
    """Whether the cache is plain per-layer (B, H, L, D) tensors that rows can be padded into and cut from."""
    return all(type(layer) in (DynamicLayer, BufferedLayer) for layer in cache.layers)


def pad_left(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Zero-pad `t` at the start of `dim` up to `length` (left padding of attention masks)."""
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)
