"""Atomic training checkpoints: weights, optimizers, RNG states, data cursor, step.

Layout of one checkpoint (`RUN_DIR/checkpoints/step-000012/`):
  policy/        Policy.save(): one adapter (or full weights) per agent + tokenizer + manifest
  trainer.pt     optimizer state dicts per update group (the learning rate is a function of the step)
  rng.pt         python, numpy, torch (CPU and CUDA) RNG states
  state.json     {"step": 12, "cursor": 96, ...}: readable without torch

A checkpoint is written into a hidden temp directory and renamed into place, then `latest` is
replaced atomically; a SIGKILL at any moment leaves either the previous or the new checkpoint,
never half of one. The coach cache needs nothing here: it is SQLite and commits per judgment.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mappa.errors import MappaError
from mappa.tracking import RUN_LOGS, drop_lines_after

KEEP_LAST = 2  # older complete checkpoints are deleted; eval and episodes live elsewhere


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    policy: Any,
    optimizers: dict[str, torch.optim.Optimizer],
    state: dict[str, Any],
) -> Path:
    """Write checkpoint `step` atomically and point `latest` at it; returns its directory."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    policy.save(tmp / "policy")
    torch.save({"optimizers": {k: o.state_dict() for k, o in optimizers.items()}}, tmp / "trainer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=1), encoding="utf-8")
    _fsync_dir(tmp)
    if final.exists():  # a re-run of the same step after resume: replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    pointer = root / ".latest.tmp"
    pointer.write_text(final.name, encoding="utf-8")
    os.replace(pointer, root / "latest")
    _fsync_dir(root)
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-KEEP_LAST]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None; half-written temp directories are ignored."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    if pointer.is_file():
        candidate = root / pointer.read_text(encoding="utf-8").strip()
        if (candidate / "state.json").is_file():
            return candidate
    complete = sorted(p for p in root.glob("step-*") if (p / "state.json").is_file())
    return complete[-1] if complete else None


def load_checkpoint(
    directory: str | Path,
    *,
    policy: Any,
    optimizers: dict[str, torch.optim.Optimizer],
) -> dict[str, Any]:
    """Restore weights, optimizer states and RNG states in place; returns state.json."""
    directory = Path(directory)
    state_file = directory / "state.json"
    if not state_file.is_file():
        raise MappaError(f"{directory}: not a checkpoint (state.json missing)")
    policy.load_weights(directory / "policy")
    trainer = torch.load(directory / "trainer.pt", map_location="cpu", weights_only=False)
    missing = set(optimizers) - set(trainer["optimizers"])
    if missing:
        raise MappaError(
            f"{directory}/trainer.pt: no optimizer state for {sorted(missing)}; the config's agents differ"
        )
    for k, opt in optimizers.items():
        opt.load_state_dict(trainer["optimizers"][k])
    set_rng_state(torch.load(directory / "rng.pt", map_location="cpu", weights_only=False))
    return json.loads(state_file.read_text(encoding="utf-8"))


def restore_run(
    run_dir: str | Path, *, policy: Any, optimizers: dict[str, torch.optim.Optimizer]
) -> tuple[Path, dict[str, Any]] | None:
    """Resume a run in place: load its latest complete checkpoint and forget log lines of later steps (the
    step a kill interrupted runs again). Without a checkpoint yet, the logs are cleared to start over cleanly.
    Returns (checkpoint, state.json) or None."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        for name in RUN_LOGS:
            (Path(run_dir) / name).unlink(missing_ok=True)
        return None
    state = load_checkpoint(ckpt, policy=policy, optimizers=optimizers)
    for name in RUN_LOGS:
        drop_lines_after(Path(run_dir) / name, state["step"])
    return ckpt, state
