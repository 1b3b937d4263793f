"""LoRA adapters loaded into a running `mappa serve` under names of their own (vLLM's runtime LoRA loading).

`ServedPolicy` wraps the served `mappa.policy.policy.Policy` and answers to three kinds of model name: the base
(adapters off), the agents the policy was built with, and adapters loaded at run time from PEFT
directories (`load`, `unload`). It offers what the decoder and the chat engine use of a policy (`active`,
`chat_ids`, the tokenizer and stop ids), so requests for a loaded adapter batch and decode like any other.

An adapter is held in a slot: peft modules created once per adapter shape and refilled in place by the
next load of that shape (see `ServedPolicy.load`). Loads and unloads change the model's weights, so the
chat engine runs them on its worker thread between batches (`ChatEngine.run`), never while a batch decodes.
At most `max_loaded` adapters are loaded at once: a load past that unloads the least recently used one
(requested or loaded longest ago), and slots beyond that number are deleted, so memory stays bounded.

An adapter's files are read once, through the directory descriptor the adapter roots opened
(`mappa.serving.guard.AdapterDir`, `mappa.beneath`): no link followed, no hard-linked, special or
oversized file, and nothing read by path again, not even by peft. A slot is made from the checked config (a
plain LoRA config whose rank is that of the tensors read), so a config cannot ask for an initialisation that
rewrites the base weights, or for modules of a rank its file does not hold.
"""

from __future__ import annotations

import itertools
import json
import re
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from mappa.beneath import FileRefused, read_beneath
from mappa.errors import MappaError
from mappa.policy.policy import Policy
from mappa.serving.guard import AdapterDir
from mappa.types import Message

MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json: peft's are a few KB
# adapter_model.safetensors: a rank-64 adapter on every linear layer of a 70B model is ~1.7 GB in bfloat16
MAX_ADAPTER_BYTES = 4 << 30


class ServedPolicy:
    """A policy plus adapters loaded at run time (see the module docstring). `base_name` and `agents` are the
    names served from the policy itself; a loaded adapter's name may not shadow them."""

    def __init__(
        self,
        policy: Policy,
        base_name: str,
        agents: Sequence[str],
        max_loaded: int = 16,
        max_adapter_bytes: int = MAX_ADAPTER_BYTES,
    ) -> None:
        if max_loaded < 1:
            raise MappaError(f"--max-loaded-adapters must be >= 1 (got {max_loaded})")
        self.policy = policy
        self.max_loaded = max_loaded
        self.max_adapter_bytes = max_adapter_bytes
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

    def load(self, name: str, directory: AdapterDir, replace: bool = False) -> list[str]:
        """Load the PEFT adapter in `directory` (opened by `AdapterRoots.open`) as model `name` (`replace`: an
        adapter already loaded under that name gives way); returns the names unloaded to stay within
        `max_loaded`. Errors are MappaErrors worded like vLLM's.

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
        path = directory.path
        settings, state = _read_adapter(directory, self.max_adapter_bytes)
        shape = tuple(settings.values())
        evicted = []
        with self.policy.active(self.policy.agents[0]):  # the lock: nobody decodes while modules change
            while name not in self.loaded and len(self.loaded) >= self.max_loaded:
                evicted.append(next(iter(self._recent)))
                self._release(evicted[-1])
            free = self._free.setdefault(shape, [])
            if not free:
                self._trim_slots()
            slot = free.pop() if free else self._new_slot(settings, path)
            self._shapes[slot] = shape
            try:
                _fill(self._slot_params[slot], state, path)
            except MappaError:
                free.append(slot)
                raise
            if name in self.loaded:
                self._release(name)
        self.loaded[name] = (slot, path)
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

    def _new_slot(self, settings: dict[str, Any], path: str) -> str:
        """peft modules for one more adapter of this shape (their values filled by the caller), made from the
        checked settings: nothing is read again, and no initialisation runs that could touch the base."""
        from peft import LoraConfig

        slot = f"served_{next(self._keys)}"
        model = self.policy.model
        task_type = next(iter(model.peft_config.values())).task_type
        try:
            targets = list(settings["target_modules"])
            config = LoraConfig(
                **{**settings, "target_modules": targets},
                task_type=task_type,
                init_lora_weights=False,  # the values come from the file; pissa-like inits rewrite the base
                inference_mode=True,
            )
            model.add_adapter(slot, config)
        except Exception as e:  # noqa: BLE001 - a bad adapter is the client's error, the server stays up
            _drop(model, slot)
            first = str(e).splitlines()[0][:200] if str(e) else ""
            raise MappaError(f"cannot load adapter {path}: {type(e).__name__}: {first}") from None
        marker = f".{slot}."
        self._slot_params[slot] = {
            n.replace(marker, "."): p for n, p in model.named_parameters() if marker in n
        }  # fmt: skip
        return slot


def _read_adapter(directory: AdapterDir, max_bytes: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(the settings that shape the adapter's slot, its tensors by PEFT key), both parsed from bytes read through
    `directory`'s descriptor."""
    from safetensors.torch import load

    path = directory.path
    try:
        raw_config = read_beneath(directory.fd, "adapter_config.json", MAX_CONFIG_BYTES)
        raw_weights = read_beneath(directory.fd, "adapter_model.safetensors", max_bytes)
    except FileRefused as e:
        if e.kind == "missing":
            files = "adapter_config.json and adapter_model.safetensors"
            raise MappaError(f"No adapter found for {path} ({files})") from None
        raise MappaError(f"lora_path {path}: {e}") from None
    try:
        config = json.loads(raw_config)
        state = load(raw_weights)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type on damaged files
        raise MappaError(f"cannot read adapter {path} ({type(e).__name__})") from None
    if not isinstance(config, dict):
        raise MappaError(f"cannot read adapter {path} (adapter_config.json is not an object)")
    settings = _plain_lora(config, path)
    _check_rank(state, settings["r"], path)
    return settings, state


# What a plain LoRA config may hold besides the settings that shape a slot: keys that change nothing when the
# adapter serves. Any other key set to something (DoRA, modules_to_save, rank or alpha patterns, layer
# replication, ...) changes the modules or their scaling, and is refused rather than ignored.
_INERT_KEYS = frozenset({
    "peft_type", "task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "lora_dropout", "init_lora_weights", "bias", "megatron_core", "qalora_group_size",
    "runtime_config",
})  # fmt: skip
_SHAPE_KEYS = ("r", "lora_alpha", "target_modules", "use_rslora", "fan_in_fan_out")
_MODULE_NAME = re.compile(r"[A-Za-z0-9_.]{1,200}")  # a name, never a pattern that peft would run as a regex


def _plain_lora(config: dict[str, Any], path: str) -> dict[str, Any]:
    """The settings of `_SHAPE_KEYS` from a plain LoRA adapter's config; MappaError for any other config."""
    unsupported = sorted(k for k, v in config.items() if v and k not in _INERT_KEYS and k not in _SHAPE_KEYS)
    if config.get("peft_type", "LORA") != "LORA" or config.get("bias", "none") != "none" or unsupported:
        what = f" (it sets {', '.join(unsupported[:3])})" if unsupported else ""
        raise MappaError(f"adapter {path}: only plain LoRA adapters are supported{what}")
    r, alpha, targets = config.get("r"), config.get("lora_alpha"), config.get("target_modules")
    if type(r) is not int or r < 1 or type(alpha) not in (int, float) or alpha <= 0:
        raise MappaError(f"adapter {path}: adapter_config.json needs a positive r and lora_alpha")
    if (
        not isinstance(targets, list)
        or not targets
        or not all(isinstance(t, str) and _MODULE_NAME.fullmatch(t) for t in targets)
    ):
        raise MappaError(f"adapter {path}: adapter_config.json's target_modules must be a list of module names")
    return {
        "r": r,
        "lora_alpha": alpha,
        "target_modules": tuple(sorted(set(targets))),
        "use_rslora": bool(config.get("use_rslora")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
    }


def _check_rank(state: dict[str, torch.Tensor], r: int, path: str) -> None:
    """Every tensor a LoRA matrix of rank `r`: a slot then holds no more than the file did per module."""
    for key, value in state.items():
        kind = key.rsplit(".", 2)[-2] if key.endswith(".weight") else ""
        rank = value.shape[0] if kind == "lora_A" and value.dim() == 2 else None
        rank = value.shape[1] if kind == "lora_B" and value.dim() == 2 else rank
        if rank != r:
            raise MappaError(f"adapter {path}: {key} is not a LoRA matrix of rank {r} (adapter_config.json's r)")


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
