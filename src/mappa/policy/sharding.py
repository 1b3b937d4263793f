"""One update group's weights sharded over several processes with FSDP2 (`torch.distributed.fsdp.fully_shard`).

With `train.fsdp_ranks: N` (and `--ray`), an update group's trainer is N processes, one per GPU (or N CPU
processes talking over gloo, which is how CI runs it). Each holds a 1/N shard of every parameter, gradient
and AdamW moment; a forward or backward pass gathers one decoder layer at a time and reduce-scatters its
gradients. A rank computes the loss on its share of every mini-batch, so the ranks together take the same
optimizer step a single process would (`tests/test_sharding.py` checks the weights agree).

Every function here is a no-op without an initialised process group, which is every local run: the
policy, the update and the trainer actors call them unconditionally. Collectives (`host` of a sharded
tensor, `all_sum`) must be called by every rank of the group in the same order.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from mappa.errors import MappaError

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

TIMEOUT = datetime.timedelta(minutes=30)  # a rank that waits longer for its peers has lost one


def rank_world() -> tuple[int, int]:
    """This process's rank and the group's size; (0, 1) when nothing is sharded."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init(rank: int, world: int, address: str, device: str) -> None:
    """Join the group of `world` ranks whose first rank listens at `address` (host:port): NCCL between GPUs,
    gloo between CPU processes. Blocks until every rank has joined."""
    if device.startswith("cuda"):
        torch.cuda.set_device(0)  # Ray shows each rank its one GPU as device 0
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=world, timeout=TIMEOUT)


def shard_modules(modules: Iterable[torch.nn.Module], device: str) -> None:
    """`fully_shard` each decoder layer (the unit gathered at a time), then each model's remaining weights
    (embeddings, norm, LM head). Decoder layers are the classes the model names in `_no_split_modules`, as
    accelerate's FSDP auto-wrap policy finds them. A model in a half dtype computes in it with float32 trained
    shards (`mixed_precision`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (rank_world()[1],))
    for model in modules:
        layer_names = set(_no_split_modules(model))
        layers = [m for m in model.modules() if type(m).__name__ in layer_names]
        if not layers:
            raise MappaError(f"train.fsdp_ranks: {type(model).__name__} names no decoder layer class to shard")
        policy = mixed_precision(model)
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)


def mixed_precision(model: torch.nn.Module) -> MixedPrecisionPolicy:
    """FSDP2's precision for `model`: with weights in a half dtype (bfloat16 on a GPU), its trained weights become
    float32 (the shards AdamW steps: at lr 1e-6 a step is far below bfloat16's rounding), gathered in the half
    dtype for compute, gradients reduced in float32; frozen weights stay as they are. A float32 model: FSDP's
    default, everything in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    half = [p.dtype for p in model.parameters() if p.dtype in (torch.bfloat16, torch.float16)]
    if not half:
        return MixedPrecisionPolicy()
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # in place: the parameter objects (peft's, the policy's) stay the same
    return MixedPrecisionPolicy(param_dtype=half[0], reduce_dtype=torch.float32)


def _no_split_modules(model: torch.nn.Module) -> list[str]:
    """The decoder layer class names of a HF model, through a peft wrapper if there is one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(getattr(base, "_no_split_modules", None) or [])


def host(t: torch.Tensor) -> torch.Tensor:
    """A copy of a tensor's whole value on the CPU; a sharded one is gathered first (a collective)."""
    t = t.detach()
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.to("cpu", copy=True).contiguous()


def like(target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` laid out as `target`: this rank's shard of it when `target` is sharded. No communication:
    every rank holds the whole value (read from the same checkpoint, or sent to every rank)."""
    if isinstance(target, DTensor):
        value = value.to(device=target.device, dtype=target.dtype)
        return distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
    return value


def all_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of `t` over the group's ranks, in place (nothing to do unsharded)."""
    if rank_world()[1] > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def host_state(state: Any) -> Any:
    """An optimizer state with every tensor whole and on the CPU (the driver that writes the checkpoint may
    have no GPU, and a checkpoint must not depend on how the weights were sharded)."""
    if isinstance(state, torch.Tensor):
        return host(state)
    if isinstance(state, dict):
        return {k: host_state(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(host_state(v) for v in state)
    return state


def optimizer_state_like(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """A whole optimizer state (as `host_state` wrote it) laid out for this rank's sharded parameters: each
    per-parameter tensor of the parameter's shape becomes this rank's shard (AdamW's moments; `step` stays)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    per_param = {
        i: {k: like(params[i], v) if isinstance(v, torch.Tensor) and v.shape == params[i].shape else v
            for k, v in s.items()}
        for i, s in state["state"].items()
    }  # fmt: skip
    return {**state, "state": per_param}


def shares(n: int, world: int, rank: int) -> list[int]:
    """The rows rank `rank` takes of `n` (every world-th, so shares differ in size by at most one)."""
    return list(range(rank, n, world))


def passes(rows: int, micro_batch_size: int) -> int:
    """Forward passes `rows` rows take in micro-batches (every rank must make as many as the busiest)."""
    return -(-rows // micro_batch_size)
