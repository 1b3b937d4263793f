"""Atomic training checkpoints: weights, optimizers, RNG states, data cursor, step.

Layout of one checkpoint (`RUN_DIR/checkpoints/step-000012/`):
  policy/        Policies.save(): one adapter (or full weights) per agent + tokenizer + manifest (safetensors, JSON);
                 a team on several base models: one such directory per base, base-0/, base-1/ ... (`mappa.policy.team`)
  trainer.pt     optimizer state dicts per update group (the learning rate is a function of the step); for weights
                 in a half dtype (a bfloat16 full copy) with the float32 masters AdamW steps
                 (`mappa.training.update.MasterAdamW`), so a resume continues from them, not from the policy files'
                 bfloat16 rounding of them
  rng.pt         python, numpy, torch (CPU and CUDA) RNG states, as tensors and plain numbers
  state.json     {"step": 12, "cursor": 96, ...}: readable without torch

Nothing here is read with pickle: trainer.pt and rng.pt hold only tensors, numbers, strings and containers of
them and are read with `torch.load(weights_only=True)`, so a tampered file is refused with one line naming it
and none of its contents runs.

A checkpoint is written into a hidden temp directory, every file and directory in it fsynced, and renamed into
place; then `latest` is replaced atomically. A SIGKILL (or a power loss) at any moment leaves either the previous
or the new checkpoint, never half of one. The coach cache needs nothing here: it is SQLite and commits per
judgment.

Since a kill cannot leave a `step-N` directory without its state.json, one that lacks it (or a file that
does not load) is damage, not an interrupted save: resuming then stops with one line naming the file and
changes nothing in the run directory, instead of starting the run over on top of its logs.
"""

from __future__ import annotations

import json
import os
import pickle  # for its error type only: nothing is unpickled here
import random
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mappa.errors import MappaError
from mappa.paths import atomic_write, fsync_path
from mappa.training.tracking import RUN_LOGS, drop_lines_after

KEEP_LAST = 2  # older complete checkpoints are deleted; eval and episodes live elsewhere
RNG_FORMAT = 2  # rng.pt as tensors and plain numbers, which `weights_only=True` reads


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


@contextmanager
def kept_rng() -> Iterator[None]:
    """Run the block without moving any RNG: a resumed run that does extra work (the self-test) before its
    next step still samples exactly what the uninterrupted run did."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def _rng_file(state: dict[str, Any]) -> dict[str, Any]:
    """`rng_state()` as rng.pt holds it: tensors and plain numbers only, which `weights_only=True` reads."""
    version, mt, gauss = state["python"]
    _, key, pos, has_gauss, cached = state["numpy"]
    out: dict[str, Any] = {
        "format": RNG_FORMAT,
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {"key": torch.from_numpy(key.astype(np.int64)), "pos": pos, "has_gauss": has_gauss, "gauss": cached},
        "torch": state["torch"],
    }
    if "cuda" in state:
        out["cuda"] = list(state["cuda"])
    return out


def _rng_from_file(saved: Any, path: Path) -> dict[str, Any]:
    """rng.pt's contents as `set_rng_state` takes them, checked on scratch generators first so that a malformed
    state is one line naming the file, before anything is restored."""
    try:
        if saved.get("format") != RNG_FORMAT:
            raise ValueError(f"format {saved.get('format')!r}, not {RNG_FORMAT}")
        py, npy = saved["python"], saved["numpy"]
        key = npy["key"].numpy().astype(np.uint32)
        state = {
            "python": (py["version"], tuple(py["state"].tolist()), py["gauss"]),
            "numpy": ("MT19937", key, npy["pos"], npy["has_gauss"], npy["gauss"]),
            "torch": saved["torch"],
        }
        if "cuda" in saved:
            state["cuda"] = list(saved["cuda"])
        random.Random().setstate(state["python"])
        np.random.RandomState().set_state(state["numpy"])
        torch.Generator().set_state(state["torch"])
        if not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in state.get("cuda", [])):
            raise TypeError("CUDA states are not byte tensors")
    except (AttributeError, KeyError, TypeError, ValueError, RuntimeError) as e:
        why = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise MappaError(f"{path}: not an RNG state ({why})") from None
    return state


def _fsync_tree(root: Path) -> None:
    """Every file and directory under `root`, and `root`, on disk: its rename may then publish it."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(Path(directory) / name)
        fsync_path(directory)


def _fsync_logs(run_dir: Path) -> None:
    """The logs' lines of the steps a checkpoint covers reach the disk before it does: after a power loss, a
    checkpoint never has steps whose lines were lost (a resume forgets lines after it, not before)."""
    for name in RUN_LOGS:
        if (run_dir / name).is_file():
            fsync_path(run_dir / name)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    policy: Any,
    optimizers: dict[str, torch.optim.Optimizer],
    state: dict[str, Any],
    keep: int = KEEP_LAST,
) -> Path:
    """Write checkpoint `step` atomically and point `latest` at it, then delete all but the `keep` newest
    (0: keep every one); returns its directory."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    for stale in root.glob(".tmp-step-*"):  # a save or replace a kill interrupted: only this process writes here
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    tmp.mkdir()
    policy.save(tmp / "policy")
    torch.save({"optimizers": {k: o.state_dict() for k, o in optimizers.items()}}, tmp / "trainer.pt")
    torch.save(_rng_file(rng_state()), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=1), encoding="utf-8")
    _fsync_tree(tmp)
    _fsync_logs(Path(run_dir))
    old = None
    if final.exists():  # a re-run of the same step after resume: moved aside first, so a kill leaves one of them
        old = root / f".tmp-step-{step:06d}-{os.getpid()}-old"
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_path(root)
    atomic_write(root / "latest", final.name)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for done in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep] if keep else []:
        shutil.rmtree(done, ignore_errors=True)
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


def resume_point(run_dir: str | Path) -> Path | None:
    """The checkpoint a resume continues from; None when the run was stopped before its first checkpoint.

    Stricter than `latest_checkpoint`: `latest` naming a checkpoint without state.json, or checkpoints of which
    none is complete, cannot come from a kill (a checkpoint appears whole by a rename), so it is an error.
    """
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    if pointer.is_file():
        named = root / pointer.read_text(encoding="utf-8").strip()
        if not (named / "state.json").is_file():
            raise MappaError(f"{named / 'state.json'}: missing (the checkpoint {pointer} names is damaged)")
    found = latest_checkpoint(run_dir)
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    if found is None and steps:
        raise MappaError(f"{steps[-1] / 'state.json'}: missing (no complete checkpoint in {root})")
    return found


def _torch_file(path: Path) -> Any:
    """A checkpoint's torch file, read without pickle (`weights_only=True`: tensors and plain values only), or
    one line naming it (missing, truncated, corrupt, or holding anything else)."""
    if not path.is_file():
        raise MappaError(f"{path}: missing (checkpoint damaged)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on pickle protocols: the one line below says it all
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # what weights_only raises on random bytes, or on a pickle of other objects
        raise MappaError(
            f"{path}: unreadable, truncated or corrupt (holds more than tensors and plain values; not loaded, "
            f"nothing in it ran)"
        ) from None
    except Exception as e:  # torch raises RuntimeError, EOFError... on damaged files
        raise MappaError(f"{path}: unreadable, truncated or corrupt ({type(e).__name__})") from None


def _state_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise MappaError(f"{path.parent}: not a checkpoint (state.json missing)")
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MappaError(f"{path}: unreadable ({type(e).__name__})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or "cursor" not in state:
        raise MappaError(f"{path}: not a checkpoint state (needs an integer step and a cursor)")
    return state


def load_checkpoint(
    directory: str | Path,
    *,
    policy: Any,
    optimizers: dict[str, torch.optim.Optimizer],
) -> dict[str, Any]:
    """Restore weights, optimizer states and RNG states in place; returns state.json.

    state.json, trainer.pt and rng.pt are read and checked before anything is restored, and the policy checks
    its own files as it loads them, so a damaged or mismatched checkpoint fails with one line naming its file.
    (The in-memory policy may then be half loaded; the caller stops, and nothing on disk has changed.)
    """
    directory = Path(directory)
    state = _state_file(directory / "state.json")
    trainer = _torch_file(directory / "trainer.pt")
    rng = _rng_from_file(_torch_file(directory / "rng.pt"), directory / "rng.pt")
    saved = trainer.get("optimizers") if isinstance(trainer, dict) else None
    if not isinstance(saved, dict):
        raise MappaError(f"{directory / 'trainer.pt'}: not a trainer state (no optimizers)")
    policy.load_weights(directory / "policy")  # first: its manifest names the agents when they differ
    missing = set(optimizers) - set(saved)
    if missing:
        raise MappaError(
            f"{directory}/trainer.pt: no optimizer state for {sorted(missing)}; the config's agents differ"
        )
    for k, opt in optimizers.items():
        try:
            opt.load_state_dict(saved[k])
        except (ValueError, KeyError) as e:  # parameter groups of another shape: other LoRA settings or model
            raise MappaError(f"{directory / 'trainer.pt'}: optimizer state of {k!r} does not fit ({e})") from None
    set_rng_state(rng)
    return state


def restore_run(
    run_dir: str | Path, *, policy: Any, optimizers: dict[str, torch.optim.Optimizer]
) -> tuple[Path, dict[str, Any]] | None:
    """Resume a run in place: load its latest complete checkpoint and forget log lines of later steps (the
    step a kill interrupted runs again). Without a checkpoint yet, the logs are cleared to start over cleanly.
    Returns (checkpoint, state.json) or None. Nothing is changed on disk unless the checkpoint loaded."""
    ckpt = resume_point(run_dir)
    if ckpt is None:
        for name in RUN_LOGS:
            (Path(run_dir) / name).unlink(missing_ok=True)
        return None
    state = load_checkpoint(ckpt, policy=policy, optimizers=optimizers)
    for name in RUN_LOGS:
        drop_lines_after(Path(run_dir) / name, state["step"])
    return ckpt, state
