"""The policy layer: one base model, one set of trainable weights per agent, batched generation, logprobs.

Agent weights (`agent_weights`):
- `lora` (default): one LoRA adapter per agent on one shared frozen base (peft multi-adapter);
- `full`: a separate full trainable copy of the base per agent;
- `shared`: one adapter used by every agent (the single-policy baseline).
In every mode the reference policy (`agent=None`) is the frozen base: adapters disabled for
`lora`/`shared` (no extra memory), the untouched base module for `full`.

Switching agents happens inside a lock, right before each forward, so a generation or a logprob
call always runs with the named agent's weights. Every adapter's parameters keep
`requires_grad=True` (peft would flip them on every switch); only the active adapter takes part in
a forward, so a backward pass reaches that agent's weights alone.

Logprobs returned by `generate` are computed from the raw logits (temperature 1, before top-p):
they are the policy's own log-probabilities, which is what PPO's importance ratio needs, and they
match `forward_logprobs` on the same tokens. Generation and `forward_logprobs` use the same layout
(left-padded prompts, explicit position ids), so the two agree to float32 rounding.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from mappa.errors import MappaError
from mappa.types import Message

MANIFEST = "mappa_policy.json"
FORMAT_VERSION = 1
AGENT_WEIGHTS = ("lora", "full", "shared")
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_SHARED_ADAPTER = "shared"


@dataclass(frozen=True)
class Generation:
    """One sampled response. Token-level fields have one entry per response token."""

    prompt_ids: tuple[int, ...]  # (P,) chat-templated prompt
    response_ids: tuple[int, ...]  # (T,) sampled tokens, EOS included when generated
    logprobs: tuple[float, ...]  # (T,) log pi(a_t | s) under the policy itself (temperature-1 logits)
    text: str  # decoded response without special tokens
    truncated: bool  # hit max_new_tokens without EOS
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None  # (T, k) (token_id, logprob) when asked


class Policy:
    """A base causal LM plus one set of trainable weights per agent (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: object,
        agents: Sequence[str],
        *,
        agent_weights: str = "lora",
        lora_r: int = 8,
        lora_alpha: int = 16,
        lora_dropout: float = 0.0,
        target_modules: Sequence[str] = DEFAULT_TARGET_MODULES,
        base_name: str | None = None,
        generation_batch_size: int = 16,
        seed: int = 0,
    ) -> None:
        agents = tuple(agents)
        if not agents:
            raise MappaError("policy: at least one agent is required")
        if len(set(agents)) != len(agents):
            raise MappaError(f"policy: duplicate agent names in {list(agents)}")
        if agent_weights not in AGENT_WEIGHTS:
            raise MappaError(f"model.agent_weights: unknown mode {agent_weights!r} (use {', '.join(AGENT_WEIGHTS)})")
        self.agents = agents
        self.agent_weights = agent_weights
        self.tokenizer = tokenizer
        self.base_name = base_name  # loadable name of the base; None: save() writes the base weights too
        self.generation_batch_size = generation_batch_size
        self.lora = {"r": lora_r, "alpha": lora_alpha, "dropout": lora_dropout, "target_modules": list(target_modules)}
        self.device = next(model.parameters()).device
        self._lock = threading.RLock()
        self._copies: dict[str, torch.nn.Module] = {}
        self._adapter: dict[str, str] = {}
        self.eos_ids = _eos_ids(tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]

        model.eval()
        model.requires_grad_(False)
        # LoRA A matrices (and full copies, which start equal to the base) are drawn from the seed so a
        # run is reproducible; fork_rng leaves the caller's global RNG untouched.
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed)
            if agent_weights == "full":
                self.model = model
                for agent in agents:
                    clone = copy.deepcopy(model)
                    clone.requires_grad_(True)
                    clone.eval()
                    self._copies[agent] = clone
            else:
                self._adapter = (
                    {a: _SHARED_ADAPTER for a in agents} if agent_weights == "shared" else _adapter_names(agents)
                )
                self.model = _wrap_lora(model, list(dict.fromkeys(self._adapter.values())), self.lora)
                self._adapter_params = [p for n, p in self.model.named_parameters() if ".lora_" in n]

    # ------------------------------------------------------------------------------------------------------------
    # Construction

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer: object, agents: Sequence[str], **options: Any) -> Policy:
        """Wrap an in-memory model (tests, notebooks); `options` as for the constructor. `base_name`: how to
        reload the base later; None makes `save` store the base weights inside the checkpoint."""
        return cls(model, tokenizer, agents, **options)

    @classmethod
    def from_config(cls, cfg: object, agents: Sequence[str], seed: int = 0, generation_batch_size: int = 16) -> Policy:
        """Load `cfg.name` (a `mappa.config.ModelConfig`) and attach one set of weights per agent."""
        from mappa.models import load_base_model

        model, tokenizer = load_base_model(cfg.name, device=cfg.device, dtype=cfg.dtype)
        policy = cls(
            model,
            tokenizer,
            agents,
            agent_weights=cfg.agent_weights,
            lora_r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=cfg.lora_target_modules,
            base_name=cfg.name,
            generation_batch_size=generation_batch_size,
            seed=seed,
        )
        if cfg.gradient_checkpointing:
            policy.enable_gradient_checkpointing()
        return policy

    @classmethod
    def from_checkpoint(cls, directory: str | Path, device: str | torch.device = "auto") -> Policy:
        """Rebuild a policy saved with `save`: base model, agents, mode, LoRA settings and weights."""
        from mappa.models import load_base_model

        directory = Path(directory)
        manifest = _read_manifest(directory)
        base = str(directory / "base") if manifest["base_name"] is None else manifest["base_name"]
        model, tokenizer = load_base_model(base, device=device)
        lora = manifest["lora"]
        policy = cls(
            model,
            tokenizer,
            manifest["agents"],
            agent_weights=manifest["agent_weights"],
            lora_r=lora["r"],
            lora_alpha=lora["alpha"],
            lora_dropout=lora["dropout"],
            target_modules=lora["target_modules"],
            base_name=manifest["base_name"],
        )
        policy.load_weights(directory)
        return policy

    def enable_gradient_checkpointing(self) -> None:
        """Recompute activations in backward. The recomputation runs with whichever agent is active at
        backward time, so call backward before the next agent's forward (the natural per-agent loop)."""
        for module in self._modules():
            # non-reentrant checkpointing needs no input that requires grad (the base embeddings are frozen)
            module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self._checkpointing = True

    _checkpointing = False

    # ------------------------------------------------------------------------------------------------------------
    # Agents and weights

    def trainable_parameters(self, agent: str) -> list[torch.nn.Parameter]:
        """Only `agent`'s weights: its LoRA matrices (the one shared adapter in `shared` mode) or its full copy."""
        self._check_agent(agent)
        if self.agent_weights == "full":
            return list(self._copies[agent].parameters())
        pattern = re.compile(rf"\.lora_\w+\.{re.escape(self._adapter[agent])}(\.|$)")
        return [p for n, p in self.model.named_parameters() if pattern.search(n)]

    def _check_agent(self, agent: str) -> None:
        if agent not in self.agents:
            raise MappaError(f"policy: unknown agent {agent!r} (agents: {', '.join(self.agents)})")

    def _modules(self) -> list[torch.nn.Module]:
        return list(self._copies.values()) if self.agent_weights == "full" else [self.model]

    @contextmanager
    def _active(self, agent: str | None) -> Iterator[torch.nn.Module]:
        """The module to call for `agent` (None: the reference), with that agent's weights switched on for
        the duration. Held under a lock so concurrent callers cannot switch adapters mid-forward."""
        if agent is not None:
            self._check_agent(agent)
        with self._lock:
            if self.agent_weights == "full":
                yield self.model if agent is None else self._copies[agent]
            elif agent is None:
                try:
                    with self.model.disable_adapter():
                        yield self.model
                finally:
                    self._unfreeze_adapters()
            else:
                name = self._adapter[agent]
                if self.model.active_adapter != name:
                    self.model.set_adapter(name)
                    self._unfreeze_adapters()
                yield self.model

    def _unfreeze_adapters(self) -> None:
        """peft freezes every inactive adapter on a switch (and all of them around disable_adapter); keep
        all trainable so an optimizer built earlier over another agent's parameters sees requires_grad=True."""
        for p in self._adapter_params:
            p.requires_grad_(True)

    # ------------------------------------------------------------------------------------------------------------
    # Tokens

    def chat_ids(self, messages: Sequence[Message]) -> list[int]:
        """Chat-template `messages` and append the assistant generation prompt."""
        text = self.tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages], add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ------------------------------------------------------------------------------------------------------------
    # Generation

    def generate(
        self,
        agent: str | None,
        conversations: Sequence[Sequence[Message]],
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 256,
        max_context_tokens: int | None = None,
        top_logprobs: int = 0,
        seed: int | None = None,
        batch_size: int | None = None,
    ) -> list[Generation]:
        """Sample one response per conversation with `agent`'s weights (None: the reference).

        Conversations are sorted by prompt length and run in batches of `batch_size` (default: the
        policy's `generation_batch_size`) with a KV cache; each sequence stops at its own EOS (the
        tokenizer's EOS or <|im_end|>), finished rows leave the batch. Results come back in input
        order. temperature 0 is greedy. A prompt longer than `max_context_tokens` raises MappaError
        (prompts are never silently cut: the agent would act on a context it never saw). `seed` makes
        sampling reproducible without touching the global RNG.
        """
        if max_new_tokens < 1:
            raise MappaError(f"generation.max_new_tokens must be >= 1 (got {max_new_tokens})")
        prompts = [self.chat_ids(c) for c in conversations]
        if max_context_tokens is not None:
            for i, p in enumerate(prompts):
                if len(p) > max_context_tokens:
                    raise MappaError(
                        f"agent {agent or 'reference'}: prompt {i} has {len(p)} tokens, more than "
                        f"generation.max_context_tokens={max_context_tokens}"
                    )
        size = batch_size or self.generation_batch_size
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: list[Generation | None] = [None] * len(prompts)
        with self.decoding(agent, temperature=temperature, top_p=top_p, seed=seed) as decoder:
            for start in range(0, len(order), size):
                chunk = order[start : start + size]
                decoder.add([prompts[i] for i in chunk], max_new_tokens, keys=chunk, top_logprobs=top_logprobs)
                while len(decoder):
                    for i, gen in decoder.step():
                        out[i] = gen
        return out  # type: ignore[return-value]

    @contextmanager
    def decoding(
        self,
        agent: str | None,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> Iterator[Decoder]:
        """A `Decoder` for `agent` (None: the reference) and one sampling setting: rows can join between
        steps (continuous batching, as `mappa serve` does). The agent's weights stay active, under the
        policy's lock, until the block ends; use the decoder from the thread that opened it.
        `prefix_cache` reuses prompt KV across decoders; only for weights that no longer change."""
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
        with torch.no_grad(), self._active(agent) as module:
            yield Decoder(self, module, temperature, top_p, generator, prefix_cache=prefix_cache, owner=agent)

    def _prefill(
        self,
        module: torch.nn.Module,
        prompts: list[list[int]],
        prefix_cache: PrefixCache | None = None,
        owner: str | None = None,
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run the prompts through the model: (KV cache left-padded to the longest prompt, last-position
        logits (B, V) in float32, attention mask (B, L), next position id (B,)).

        Prompts of equal length go through together with no padding and no mask, which keeps attention
        on the fused causal kernel; their caches are then stitched into one left-padded cache for the
        batched decode. A padded prefill needs an explicit (B, 1, L, L) mask, which sends PyTorch's CPU
        attention to its unfused path: on ~1,500-token prompts one padded batch of 8 took 2.5x as long
        as 8 unpadded ones. Caches whose layers are not plain dynamic layers (sliding windows) are
        padded the classic way. With a `prefix_cache`, a prompt that starts like a cached one prefills
        only the tokens after the shared prefix, and every prompt's KV is offered to the cache.
        """
        from transformers.cache_utils import DynamicCache

        B, L = len(prompts), max(len(p) for p in prompts)
        if min(len(p) for p in prompts) == 0:
            raise ValueError("empty prompt")
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        attn = (torch.arange(L, device=self.device)[None, :] >= (L - lengths)[:, None]).long()
        jobs: list[tuple[list[int], int, Any]] = []  # (rows, tokens already cached, cached KV per layer)
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            hit = prefix_cache.lookup(owner, p) if prefix_cache is not None else None
            if hit is not None:
                jobs.append(([i], *hit))
            else:
                groups.setdefault(len(p), []).append(i)
        jobs += [(idx, 0, None) for idx in groups.values()]
        parts = []
        for idx, cached, kv in jobs:
            ids = torch.tensor([prompts[i][cached:] for i in idx], dtype=torch.long, device=self.device)
            past = DynamicCache(ddp_cache_data=kv) if kv is not None else None
            out = module(input_ids=ids, past_key_values=past, use_cache=True, logits_to_keep=1)
            if not _stitchable(out.past_key_values):
                return self._prefill_padded(module, prompts)
            if prefix_cache is not None:
                for j, i in enumerate(idx):
                    prefix_cache.store(
                        owner,
                        prompts[i],
                        [(x.keys[j : j + 1], x.values[j : j + 1]) for x in out.past_key_values.layers],
                    )
            parts.append((torch.tensor(idx, device=self.device), len(prompts[idx[0]]), out))
        if len(parts) == 1:
            out = parts[0][2]
            return out.past_key_values, out.logits[:, -1].float(), attn, lengths
        logits = torch.empty(B, parts[0][2].logits.shape[-1], device=self.device)
        for idx, _, out in parts:
            logits[idx] = out.logits[:, -1].float()
        cache = parts[0][2].past_key_values
        for n, layer in enumerate(cache.layers):
            keys = layer.keys.new_zeros(B, layer.keys.shape[1], L, layer.keys.shape[3])
            values = layer.values.new_zeros(B, layer.values.shape[1], L, layer.values.shape[3])
            for idx, length, out in parts:  # right-aligned: the padding (masked out) comes first
                keys[idx, :, L - length :] = out.past_key_values.layers[n].keys
                values[idx, :, L - length :] = out.past_key_values.layers[n].values
            layer.keys, layer.values = keys, values
        return cache, logits, attn, lengths

    def _prefill_padded(
        self, module: torch.nn.Module, prompts: list[list[int]]
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        input_ids, attn = _left_pad(prompts, self.pad_id, self.device)
        position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
        out = module(
            input_ids=input_ids, attention_mask=attn, position_ids=position_ids, use_cache=True, logits_to_keep=1
        )
        return out.past_key_values, out.logits[:, -1].float(), attn, position_ids[:, -1] + 1

    # ------------------------------------------------------------------------------------------------------------
    # Logprobs for training

    def forward_logprobs(
        self, agent: str | None, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log pi(response | prompt) for one micro-batch: (logp (B, T), mask (B, T)), right-padded
        over responses (padded entries are 0 with mask False). Differentiable w.r.t. the agent's weights
        when grad is enabled; the reference (None) never builds a graph.

        Layout: prompts left-padded to a common length so every response starts at the same column,
        which lets the LM head run on response positions only (logits_to_keep) instead of the prompt.
        """
        if len(prompt_ids) != len(response_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
        B = len(prompt_ids)
        T = max((len(r) for r in response_ids), default=0)
        if B == 0 or T == 0:
            empty = torch.zeros(B, T, device=self.device)
            return empty, empty.bool()
        P = max(len(p) for p in prompt_ids)
        if min(len(p) for p in prompt_ids) == 0:
            raise ValueError("every prompt needs at least one token")
        input_ids = torch.full((B, P + T), self.pad_id, dtype=torch.long, device=self.device)
        attn = torch.zeros(B, P + T, dtype=torch.long, device=self.device)
        mask = torch.zeros(B, T, dtype=torch.bool, device=self.device)
        for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
            input_ids[i, P - len(p) : P] = torch.tensor(list(p), dtype=torch.long)
            attn[i, P - len(p) : P + len(r)] = 1
            if r:
                input_ids[i, P : P + len(r)] = torch.tensor(list(r), dtype=torch.long)
            mask[i, : len(r)] = True
        position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
        train_mode = self._checkpointing and torch.is_grad_enabled() and agent is not None
        with self._active(agent) as module:
            if train_mode:  # HF only checkpoints in train mode; Llama has no dropout, LoRA dropout is opt-in
                module.train()
            try:
                # logits at positions P-1 .. P+T-2 predict the response tokens at P .. P+T-1
                logits = module(
                    input_ids=input_ids, attention_mask=attn, position_ids=position_ids, logits_to_keep=T + 1
                ).logits[:, :-1]
            finally:
                if train_mode:
                    module.eval()
        logits = logits.float()  # (B, T, V)
        targets = input_ids[:, P:]
        logp = logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        return logp * mask, mask

    @torch.no_grad()
    def sequence_logprobs(
        self,
        agent: str | None,
        prompt_ids: Sequence[Sequence[int]],
        response_ids: Sequence[Sequence[int]],
        *,
        micro_batch_size: int = 8,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_logprobs` without gradients over any number of sequences, `micro_batch_size` at a time
        (grouped by length to cut padding). Returns (logp (N, T), mask (N, T)) in input order."""
        N = len(prompt_ids)
        T = max((len(r) for r in response_ids), default=0)
        logp = torch.zeros(N, T, device=self.device)
        mask = torch.zeros(N, T, dtype=torch.bool, device=self.device)
        order = sorted(range(N), key=lambda i: len(prompt_ids[i]) + len(response_ids[i]))
        for start in range(0, N, micro_batch_size):
            idx = order[start : start + micro_batch_size]
            lp, m = self.forward_logprobs(agent, [prompt_ids[i] for i in idx], [response_ids[i] for i in idx])
            rows = torch.tensor(idx, device=self.device)
            logp[rows, : lp.shape[1]] = lp
            mask[rows, : m.shape[1]] = m
        return logp, mask

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints

    def save(self, directory: str | Path) -> None:
        """Write per-agent weights (LoRA adapters in peft format, or full copies as HF model dirs), the
        tokenizer and a manifest. The base is referenced by name, or stored under base/ when it has none."""
        from safetensors.torch import save_file

        directory = Path(directory)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with self._lock:
                if self.agent_weights == "full":
                    for agent, module in self._copies.items():
                        module.save_pretrained(directory / "agents" / agent, safe_serialization=True)
                else:
                    from peft import get_peft_model_state_dict

                    for adapter in dict.fromkeys(self._adapter.values()):
                        out = directory / "adapters" / adapter
                        out.mkdir(parents=True, exist_ok=True)
                        state = get_peft_model_state_dict(self.model, adapter_name=adapter)
                        save_file(
                            {k: v.detach().contiguous().cpu() for k, v in state.items()},
                            out / "adapter_model.safetensors",
                        )
                        self.model.peft_config[adapter].save_pretrained(out)
                if self.base_name is None:
                    self._save_base(directory / "base")
                self.tokenizer.save_pretrained(directory / "tokenizer")
            manifest = {
                "format_version": FORMAT_VERSION,
                "base_name": self.base_name,
                "agent_weights": self.agent_weights,
                "agents": list(self.agents),
                "adapters": self._adapter,
                "lora": self.lora,
            }
            (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        except OSError as e:
            raise MappaError(f"cannot write checkpoint {directory} ({e.strerror or e})") from None

    def _save_base(self, out: Path) -> None:
        """The frozen base as a plain HF model directory (LoRA layers stripped from the state dict)."""
        from safetensors.torch import save_file

        if self.agent_weights == "full":
            self.model.save_pretrained(out, safe_serialization=True)
        else:
            base = self.model.get_base_model()
            state = {
                k.replace(".base_layer.", "."): v.detach().contiguous().cpu()
                for k, v in base.state_dict().items()
                if ".lora_" not in k
            }
            if base.config.tie_word_embeddings:
                state.pop("lm_head.weight", None)  # shared with embed_tokens; safetensors refuses aliases
            out.mkdir(parents=True, exist_ok=True)
            save_file(state, out / "model.safetensors", metadata={"format": "pt"})
            base.config.save_pretrained(out)
        self.tokenizer.save_pretrained(out)

    def load_weights(self, directory: str | Path) -> None:
        """Load per-agent weights saved by `save` into this policy (same agents and mode)."""
        from safetensors.torch import load_file

        directory = Path(directory)
        manifest = _read_manifest(directory)
        if manifest["agent_weights"] != self.agent_weights or list(manifest["agents"]) != list(self.agents):
            raise MappaError(
                f"{directory / MANIFEST}: checkpoint has agents {manifest['agents']} ({manifest['agent_weights']}), "
                f"this policy has {list(self.agents)} ({self.agent_weights})"
            )
        with self._lock:
            if self.agent_weights == "full":
                for agent, module in self._copies.items():
                    path = directory / "agents" / agent / "model.safetensors"
                    state = _load_safetensors(path, load_file)
                    missing, unexpected = module.load_state_dict(state, strict=False)
                    # tied weights (lm_head = embed_tokens) are saved once; anything else missing is an error
                    missing = [k for k in missing if k not in _tied_keys(module)]
                    if missing or unexpected:
                        raise MappaError(
                            f"{path}: weights do not fit the base model (missing {missing[:3]}, unexpected {unexpected[:3]})"
                        )
            else:
                from peft import set_peft_model_state_dict

                for adapter in dict.fromkeys(self._adapter.values()):
                    path = directory / "adapters" / adapter / "adapter_model.safetensors"
                    state = _load_safetensors(path, load_file)
                    expected = {n for n, _ in self.model.named_parameters() if f".{adapter}." in n}
                    try:
                        result = set_peft_model_state_dict(self.model, state, adapter_name=adapter)
                    except RuntimeError as e:  # shape mismatch: different rank or base
                        raise MappaError(
                            f"{path}: adapter does not fit this model ({str(e).splitlines()[0][:200]})"
                        ) from None
                    missing = [k for k in result.missing_keys if k in expected]
                    if missing or result.unexpected_keys:
                        raise MappaError(
                            f"{path}: adapter does not fit this model (missing {missing[:3]}, unexpected {list(result.unexpected_keys)[:3]})"
                        )


class PrefixCache:
    """Prompt KV kept after prefill, so that a prompt starting with the same tokens prefills only the rest.

    What it saves: a coach follow-up repeats the whole first request (only the reply and one line are
    new); every coach request starts with the same rubric; agents of one task share a system prompt.
    Entries are per owner (agent name, None for the base), least recently used go first once the
    stored KV passes `max_bytes`, and an entry that is a prefix of a newer one is dropped (the newer
    one covers it). Only for weights that do not change while the cache lives (serving, coaching).
    Counters: `hits`, `misses`, `tokens_reused`.
    """

    def __init__(self, max_bytes: int, min_tokens: int = 32) -> None:
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens  # shorter shared prefixes are not worth a separate prefill
        self._entries: OrderedDict[int, tuple[str | None, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = (
            OrderedDict()
        )
        self._next = 0
        self.bytes = 0
        self.hits = self.misses = self.tokens_reused = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(
        self, owner: str | None, prompt: Sequence[int]
    ) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """(n, KV per layer of the first n tokens) for the longest cached prefix of `prompt`, or None.
        n stops one short of the whole prompt: the last token must run to give the next-token logits."""
        query = torch.tensor(list(prompt), dtype=torch.long)
        best, best_key = 0, None
        for key, (who, tokens, _) in self._entries.items():
            if who != owner:
                continue
            m = min(len(tokens), len(query) - 1)
            same = tokens[:m] == query[:m]
            n = m if bool(same.all()) else int(same.logical_not().nonzero()[0])
            if n > best:
                best, best_key = n, key
        if best < self.min_tokens or best_key is None:
            self.misses += 1
            return None
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.tokens_reused += best
        kv = self._entries[best_key][2]
        return best, [(k[:, :, :best], v[:, :, :best]) for k, v in kv]

    def store(self, owner: str | None, prompt: Sequence[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep the (1, H, L, D) keys and values per layer of `prompt` (copied: the caller's tensors stay free)."""
        if len(prompt) < self.min_tokens:
            return
        size = sum(k.nbytes + v.nbytes for k, v in kv)
        if size > self.max_bytes:
            return
        tokens = torch.tensor(list(prompt), dtype=torch.long)
        for key, (who, old, _) in list(self._entries.items()):
            if who == owner and len(old) <= len(tokens) and bool((tokens[: len(old)] == old).all()):
                self._drop(key)
        while self._entries and self.bytes + size > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[self._next] = (owner, tokens, [(k.clone(), v.clone()) for k, v in kv])
        self._next += 1
        self.bytes += size

    def _drop(self, key: int) -> None:
        _, _, kv = self._entries.pop(key)
        self.bytes -= sum(k.nbytes + v.nbytes for k, v in kv)


class _BufferedLayer(DynamicLayer):
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


@dataclass
class _Row:
    """One sequence in a `Decoder` batch."""

    key: Any
    prompt: list[int]
    max_new_tokens: int
    top_k: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[tuple[tuple[int, float], ...]] = field(default_factory=list)


class Decoder:
    """Batched decoding with a KV cache that sequences join (`add`) and leave between steps.

    Made by `Policy.decoding`. `add` prefills new prompts and merges them into the running batch,
    left-padding whichever side is shorter; `step` samples one token for every running row and returns
    the rows that finished (EOS, or their own `max_new_tokens`) as `(key, Generation)`. Finished rows
    leave the cache, and padding columns no row needs any more are cut off, so a long-lived batch
    does not keep paying attention over departed prompts.
    """

    def __init__(
        self,
        policy: Policy,
        module: torch.nn.Module,
        temperature: float,
        top_p: float,
        generator: torch.Generator | None,
        *,
        prefix_cache: PrefixCache | None = None,
        owner: str | None = None,
    ) -> None:
        self.policy = policy
        self.module = module
        self.prefix_cache = prefix_cache
        self.owner = owner
        self.temperature = temperature
        self.top_p = top_p
        self.generator = generator
        self._eos = frozenset(policy.eos_ids)
        self._rows: list[_Row] = []
        self._cache: Any = None
        self._attn: torch.Tensor | None = None  # (B, L) 1 where a row has a real token
        self._pos: torch.Tensor | None = None  # (B,) position id of each row's next token
        self._logits: torch.Tensor | None = None  # (B, V) next-token logits, float32

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def width(self) -> int:
        """KV positions each row holds now (the longest row's prompt and tokens; shorter rows are padded)."""
        return 0 if self._attn is None else int(self._attn.shape[1])

    @property
    def can_add(self) -> bool:
        """False once rows are running in a cache that cannot be re-padded (sliding-window layers)."""
        return not self._rows or _stitchable(self._cache)

    def add(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, keys: Sequence[Any], top_logprobs: int = 0
    ) -> None:
        """Prefill `prompts` (token ids) and add them to the batch; `keys` identify them in `step`'s results."""
        if len(keys) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(keys)} keys")
        if max_new_tokens < 1:
            raise MappaError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
        if not prompts:
            return
        if not self.can_add:
            raise RuntimeError("this model's cache cannot take new rows mid-batch; wait for the batch to finish")
        prompts = [list(p) for p in prompts]
        cache, logits, attn, pos = self.policy._prefill(self.module, prompts, self.prefix_cache, self.owner)
        rows = [_Row(k, p, max_new_tokens, top_logprobs) for k, p in zip(keys, prompts, strict=True)]
        if not self._rows:
            self._rows = rows
            self._cache, self._logits, self._attn, self._pos = cache, logits, attn, pos
            if _stitchable(cache):
                self._reserve([[(layer.keys, layer.values)] for layer in cache.layers], attn.shape[1])
            return
        L = max(self._attn.shape[1], attn.shape[1])
        self._rows.extend(rows)
        self._reserve(
            [[(a.keys, a.values), (b.keys, b.values)] for a, b in zip(self._cache.layers, cache.layers, strict=True)],
            L,
        )
        self._attn = torch.cat([_pad_left(self._attn, L, 1), _pad_left(attn, L, 1)])
        self._pos = torch.cat([self._pos, pos])
        self._logits = torch.cat([self._logits, logits])

    def _reserve(self, blocks: list[list[tuple[torch.Tensor, torch.Tensor]]], width: int) -> None:
        """New cache layers from blocks of rows per layer (see `_BufferedLayer`), `width` columns wide,
        with room for every running row's remaining tokens."""
        spare = max(r.max_new_tokens - len(r.tokens) for r in self._rows)
        self._cache.layers[:] = [_BufferedLayer(layer_blocks, width, spare) for layer_blocks in blocks]

    def step(self) -> list[tuple[Any, Generation]]:
        """Sample the next token of every running row; return the rows that finished with it."""
        if not self._rows:
            return []
        logp = torch.log_softmax(self._logits, dim=-1)
        tok = _sample(self._logits, self.temperature, self.top_p, self.generator)
        tok_lp = logp.gather(1, tok[:, None]).squeeze(1)
        k = min(max(r.top_k for r in self._rows), logp.shape[-1])
        if k:
            top_v, top_i = (t.tolist() for t in logp.topk(k, dim=-1))
        finished: list[tuple[Any, Generation]] = []
        keep: list[int] = []
        for j, (row, t, lp) in enumerate(zip(self._rows, tok.tolist(), tok_lp.tolist(), strict=True)):
            row.tokens.append(t)
            row.logprobs.append(lp)
            if row.top_k:
                row.tops.append(tuple(zip(top_i[j][: row.top_k], top_v[j][: row.top_k], strict=True)))
            if t in self._eos or len(row.tokens) >= row.max_new_tokens:
                finished.append((row.key, self._generation(row, stopped=t in self._eos)))
            else:
                keep.append(j)
        if not keep:
            self._rows, self._cache, self._attn, self._pos, self._logits = [], None, None, None, None
            return finished
        if len(keep) < len(self._rows):
            self._select(keep)
            tok = tok[keep]
        self._attn = torch.cat([self._attn, self._attn.new_ones(len(keep), 1)], dim=1)
        out = self.module(
            input_ids=tok[:, None],
            attention_mask=self._attn,
            position_ids=self._pos[:, None],
            past_key_values=self._cache,
            use_cache=True,
        )
        self._cache = out.past_key_values
        self._logits = out.logits[:, -1].float()
        self._pos = self._pos + 1
        return finished

    def _select(self, keep: list[int]) -> None:
        """Keep only rows `keep`, then drop leading columns that are padding for every remaining row."""
        idx = torch.tensor(keep, device=self._attn.device)
        self._rows = [self._rows[j] for j in keep]
        self._attn, self._pos = self._attn[idx], self._pos[idx]
        if not _stitchable(self._cache):
            self._cache.batch_select_indices(idx)
            return
        first = int(self._attn.any(dim=0).long().argmax())
        self._attn = self._attn[:, first:]
        # one block per kept row: views, so each row is copied once, straight into the new buffer
        self._reserve(
            [
                [(x.keys[j : j + 1, :, first:], x.values[j : j + 1, :, first:]) for j in keep]
                for x in self._cache.layers
            ],
            self._attn.shape[1],
        )

    def _generation(self, row: _Row, stopped: bool) -> Generation:
        return Generation(
            prompt_ids=tuple(row.prompt),
            response_ids=tuple(row.tokens),
            logprobs=tuple(row.logprobs),
            text=self.policy.tokenizer.decode(row.tokens, skip_special_tokens=True),
            truncated=not stopped,
            top_logprobs=tuple(row.tops) if row.top_k else None,
        )


# ----------------------------------------------------------------------------------------------------------------
# Helpers


def _eos_ids(tokenizer: object) -> tuple[int, ...]:
    """Stop tokens: the tokenizer's EOS and ChatML's <|im_end|> (turn end), when they exist."""
    ids = []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id and im_end not in ids:
        ids.append(im_end)
    if not ids:
        raise MappaError("tokenizer has no EOS token and no <|im_end|>: generation could never stop")
    return tuple(ids)


def _adapter_names(agents: Sequence[str]) -> dict[str, str]:
    """peft keeps adapters in ModuleDicts, whose keys may not contain '.', and warns about names that are
    substrings of 'lora_' (their weights could be mistaken on load); map agent names to safe keys."""
    names: dict[str, str] = {}
    for agent in agents:
        name = "agent_" + re.sub(r"[^0-9A-Za-z_]", "_", agent)
        if name in names.values():
            name = f"{name}_{len(names)}"
        names[agent] = name
    return names


def _wrap_lora(model: torch.nn.Module, adapters: list[str], lora: dict) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    def config() -> LoraConfig:
        return LoraConfig(
            r=lora["r"],
            lora_alpha=lora["alpha"],
            lora_dropout=lora["dropout"],
            target_modules=list(lora["target_modules"]),
            task_type="CAUSAL_LM",
            bias="none",
        )

    try:
        with warnings.catch_warnings():  # transformers deprecation noise raised from inside peft
            warnings.simplefilter("ignore", FutureWarning)
            peft_model = get_peft_model(model, config(), adapter_name=adapters[0])
            for name in adapters[1:]:
                peft_model.add_adapter(name, config())
    except ValueError as e:  # e.g. target modules not found in the base
        raise MappaError(f"model.lora_target_modules: {str(e).splitlines()[0][:200]}") from None
    peft_model.set_adapter(adapters[0])
    for n, p in peft_model.named_parameters():
        p.requires_grad_(".lora_" in n)
    peft_model.eval()
    return peft_model


def _stitchable(cache: Any) -> bool:
    """Whether the cache is plain per-layer (B, H, L, D) tensors that rows can be padded into and cut from."""
    return all(type(layer) in (DynamicLayer, _BufferedLayer) for layer in cache.layers)


def _pad_left(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Zero-pad `t` at the start of `dim` up to `length` (left padding of attention masks)."""
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _left_pad(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    attn = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        if not s:
            raise ValueError("empty prompt")
        ids[i, L - len(s) :] = torch.tensor(s, dtype=torch.long)
        attn[i, L - len(s) :] = 1
    return ids.to(device), attn.to(device)


def _sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """(b, V) logits -> (b,) token ids: greedy at temperature 0, else temperature + nucleus sampling."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, sorted_i = probs.sort(dim=-1, descending=True)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, sorted_i, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def _read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST
    if not path.is_file():
        raise MappaError(f"{directory}: not a mappa policy checkpoint ({MANIFEST} not found)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise MappaError(f"{path}:{e.lineno}: invalid JSON") from None
    for key in ("agents", "agent_weights", "base_name", "lora"):
        if key not in manifest:
            raise MappaError(f"{path}: missing field {key!r}")
    return manifest


def _load_safetensors(path: Path, load_file) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise MappaError(f"{path}: weights file not found")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error type on truncated/corrupt files
        raise MappaError(f"{path}: unreadable weights ({type(e).__name__})") from None


def _tied_keys(module: torch.nn.Module) -> set[str]:
    return {"lm_head.weight"} if module.config.tie_word_embeddings else set()
