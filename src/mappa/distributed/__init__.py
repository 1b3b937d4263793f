"""`mappa train CONFIG --ray local|auto|ADDRESS`: the same training loop, its work placed on a Ray cluster.

- **Rollout workers** (`ray.rollout_workers` actors) each hold a copy of the policy, a sandbox pool and a
  coach, and play a share of every batch at once; with `generation.backend: server` they sample from the
  generation server instead of their copy. Episodes come back as records.
- **One trainer actor per update group** (`train.gpus_per_agent` GPUs each, 0 on a CPU) holds the group's
  weights and optimizer, computes reference and old log-probs and runs the update
  (`mappa.training.update.apply_update`); it also holds the other agents' current weights, so that any trainer can save
  a checkpoint or publish adapters for a generation server exactly as the local run does.
- After each step the new weights go from each trainer to every other actor through Ray's object store (the
  driver never holds them); checkpoints are written to the same run directory with the same files, so
  `mappa train --resume RUN_DIR --ray ...` (or without `--ray`) continues either kind of run.

The local mode never imports this package, nor Ray. Ray is an optional extra: `pip install 'mappa-rl[ray]'`.
"""

from __future__ import annotations

from mappa.distributed.cluster import RAY_MISSING, Cluster, placement

__all__ = ["RAY_MISSING", "Cluster", "placement"]
