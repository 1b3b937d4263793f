"""LoRA adapters loaded into a running `mappa serve` under names of their own (vLLM's runtime LoRA loading).

`ServedPolicy` wraps the served `mappa.policy.Policy` and answers to three kinds of model name: the base
(adapters off), the agents the policy was built with, and adapters loaded at run time from PEFT
directories (`load`, `unload`). It offers what the decoder and the chat engine use of a policy (`active`,
`chat_ids`, the tokenizer and stop ids), so requests for a loaded adapter batch and decode like any other.

An adapter is held in a slot: peft modules created once per adapter shape and refilled in place by the
next load of that shape (see `ServedPolicy.load`). Loads and unloads change the model's weights, so the
chat engine runs them on its worker thread between batches (`ChatEngine.run`), never while a batch decodes.
At most `max_loaded` adapters are loaded at once: a load past that unloads the least recently used one
(requested or loaded longest ago), and slots beyond that number are deleted, so memory stays bounded.
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from mappa.errors import MappaError
from mappa.policy import Policy
from mappa.types import Message


class ServedPolicy:
    """A policy plus adapters loaded at run time (see the module docstring). `base_name` and `agents` are the
    names served from the policy itself; a loaded adapter's name may not shadow them."""

    def __init__(self, policy: Policy, base_name: str, agents: Sequence[str], max_loaded: int = 16) -> None:
        if max_loaded < 1:
            raise MappaError(f"--max-loaded-adapters must be >= 1 (got {max_loaded})")
        self.policy = policy
        self.max_loaded = max_loaded
        self.base_name = base_name
        self.agents = tuple(agents)  # the policy's own agents that are served
        self.tokenizer = policy.tokenizer
        self.eos_ids = policy.eos_ids
        self.pad_id = policy.pad_id
        self.device = policy.device
        self.loaded: dict[str, tuple[str, str]] = {}  # served name -> (its slot: a peft adapter key, directory)
        self._recent: OrderedDict[str, None] = OrderedDict()  # loaded names, least recently used first
        self._keys = itertools.count()
        self._free: dict[tuple, list[str]] = {}  # adapter shape -> slots not serving anything
        self._shapes: dict[str, tuple] = {}  # slot -> its shape
        self._slot_params: dict[str, dict[str, torch.Tensor]] = {}  # slot -> its parameters by PEFT file key

    def names(self) -> list[str]:
        return [self.base_name, *self.agents, *self.loaded]

    def resolve(self, model: str) -> str | None:
        """The engine's key for a requested model name: None for the base, else the name itself. A loaded
        adapter asked for counts as used (the last to be evicted)."""
        if model == self.base_name:
            return None
        if model in self.loaded:
            self._recent[model] = None
            self._recent.move_to_end(model)
            return model
        if model in self.agents:
            return model
        raise KeyError(model)

    def chat_ids(self, messages: Sequence[Message], template_kwargs: dict[str, Any] | None = None) -> list[int]:
        return self.policy.chat_ids(messages, template_kwargs)

    @contextmanager
    def active(self, name: str | None) -> Iterator[torch.nn.Module]:
        """The module with `name`'s weights on, under the policy's lock (as `Policy.active`)."""
        if name not in self.loaded:
            with self.policy.active(name) as module:
                yield module
            return
        # Any own agent takes the policy's lock and leaves adapters on; then switch to the loaded one. The
        # policy switches back by itself: it compares the active adapter before every forward.
        with self.policy.active(self.policy.agents[0]) as module:
            module.set_adapter(self.loaded[name][0])
            yield module

    def load(self, name: str, path: str, replace: bool = False) -> list[str]:
        """Load the PEFT adapter directory `path` as model `name` (`replace`: an adapter already loaded under
        that name gives way); returns the names unloaded to stay within `max_loaded`. Errors are MappaErrors
        worded like vLLM's.

        Adapters live in slots: peft modules created once per adapter shape (rank, alpha, target modules) and
        refilled in place. Creating a slot costs seconds (peft walks the whole model, more slowly the more
        adapters it holds); refilling one is a copy of the adapter's tensors. A trainer that loads every
        step's new versions before unloading the old ones settles on two slots per agent."""
        if name in (self.base_name, *self.agents):
            raise MappaError(f"The lora adapter name '{name}' is taken by a served model.")
        if name in self.loaded and not replace:
            raise MappaError(f"The lora adapter '{name}' has already been loaded.")
        if self.policy.agent_weights == "full":
            raise MappaError("this server holds full-weight agents; loading LoRA adapters needs a LoRA-served model")
        shape, state = _read_adapter(Path(path))
        evicted = []
        with self.policy.active(self.policy.agents[0]):  # the lock: nobody decodes while modules change
            while name not in self.loaded and len(self.loaded) >= self.max_loaded:
                evicted.append(next(iter(self._recent)))
                self._release(evicted[-1])
            free = self._free.setdefault(shape, [])
            if not free:
                self._trim_slots()
            slot = free.pop() if free else self._new_slot(path)
            self._shapes[slot] = shape
            try:
                _fill(self._slot_params[slot], state, path)
            except MappaError:
                free.append(slot)
                raise
            if name in self.loaded:
                self._release(name)
        self.loaded[name] = (slot, str(path))
        self._recent[name] = None
        self._recent.move_to_end(name)
        return evicted

    def unload(self, name: str) -> None:
        """Forget the adapter loaded as `name` (its slot waits for the next load); the policy's own agents
        cannot be unloaded."""
        if name not in self.loaded:
            if name in (self.base_name, *self.agents):
                raise MappaError(f"'{name}' is not a LoRA adapter loaded at run time; it cannot be unloaded")
            raise KeyError(name)
        with self.policy.active(self.policy.agents[0]):
            self._release(name)

    def _release(self, name: str) -> None:
        slot, _ = self.loaded.pop(name)
        self._recent.pop(name, None)
        self._free.setdefault(self._shapes[slot], []).append(slot)

    def _trim_slots(self) -> None:
        """Before a new slot: delete free slots (of other shapes) until the slots fit in `max_loaded`."""
        for free in self._free.values():
            while free and len(self._slot_params) >= self.max_loaded:
                slot = free.pop()
                _drop(self.policy.model, slot)
                del self._slot_params[slot], self._shapes[slot]

    def _new_slot(self, path: str) -> str:
        """peft modules for one more adapter of this shape (with `path`'s weights, refilled by the caller)."""
        slot = f"served_{next(self._keys)}"
        model = self.policy.model
        try:
            model.load_adapter(str(path), adapter_name=slot, is_trainable=False)
        except Exception as e:  # noqa: BLE001 - a bad adapter is the client's error, the server stays up
            _drop(model, slot)
            first = str(e).splitlines()[0][:200] if str(e) else ""
            raise MappaError(f"cannot load adapter {path}: {type(e).__name__}: {first}") from None
        marker = f".{slot}."
        self._slot_params[slot] = {
            n.replace(marker, "."): p for n, p in model.named_parameters() if marker in n
        }  # fmt: skip
        return slot


def _read_adapter(directory: Path) -> tuple[tuple, dict[str, torch.Tensor]]:
    """(the adapter's shape: what a slot must share with it, its tensors by PEFT key)."""
    from safetensors.torch import load_file

    config_file, weights = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    if not config_file.is_file() or not weights.is_file():
        raise MappaError(f"No adapter found for {directory} (adapter_config.json and adapter_model.safetensors)")
    try:
        config = json.loads(config_file.read_text())
        state = load_file(str(weights))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type on damaged files
        raise MappaError(f"cannot read adapter {directory} ({type(e).__name__})") from None
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora") or config.get("modules_to_save"):
        raise MappaError(f"adapter {directory}: only plain LoRA adapters are supported (no DoRA, no modules_to_save)")
    targets = config.get("target_modules")
    shape = (config.get("r"), config.get("lora_alpha"), repr(sorted(targets) if isinstance(targets, list) else targets),
             bool(config.get("use_rslora")), config.get("bias", "none"))  # fmt: skip
    return shape, state


def _fill(params: dict[str, torch.Tensor], state: dict[str, torch.Tensor], path: str) -> None:
    """Copy an adapter's tensors into a slot's parameters; they must match one for one."""
    if set(state) != set(params):
        missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        raise MappaError(
            f"adapter {path} does not fit the served model (missing {missing[:2]}, unexpected {extra[:2]})"
        )
    for key, value in state.items():
        if params[key].shape != value.shape:
            raise MappaError(f"adapter {path} does not fit the served model ({key}: {tuple(value.shape)})")
    with torch.no_grad():
        for key, value in state.items():
            params[key].copy_(value)


def _drop(model: Any, key: str) -> None:
    if key in model.peft_config:
        model.delete_adapter(key)
