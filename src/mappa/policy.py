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

Logprobs returned by `generate` are those of the distribution the tokens were drawn from: the logits
divided by the sampling temperature (`scaled_logits`; before top-p, whose truncation is left out as in
TRL and verl). `forward_logprobs(..., temperature=T)` computes the same thing for the update, so PPO's
ratio, the KL term and the stored old log-probs all refer to the sampled distribution. Temperature 0
(greedy) has no distribution of its own: its log-probs are the raw logits'. Generation and
`forward_logprobs` use the same layout (left-padded prompts, explicit position ids), so the two agree to
float32 rounding.

`generate` is a plain batched loop (unpadded prefill, finished rows leave the batch). Continuous
batching, KV layers with reserved room and the prefix cache are serving concerns: `mappa.serving`
builds them on this module's `active`, `prefill_padded` and `sample_step`; training never imports it.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from mappa import sharding
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
    logprobs: tuple[float, ...]  # (T,) log pi(a_t | s) at the sampling temperature (`scaled_logits`)
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
        base_init_kwargs: Mapping[str, Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        generation_batch_size: int = 16,
        seed: int = 0,
    ) -> None:
        from mappa.models import portable_init_kwargs

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
        self.base_init_kwargs = portable_init_kwargs(base_init_kwargs or {})  # how it was loaded (model.init_kwargs)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})  # generation.chat_template_kwargs
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
                self._name_base(base_name)

    def _name_base(self, base_name: str | None) -> None:
        """Saved adapters name the base as given (the embedded model: its hub id), never the cache directory it
        was read from: vLLM, peft's AutoPeftModel and the Hub resolve it (`mappa.models.public_name`)."""
        from mappa.models import public_name

        if base_name is None:
            return
        for config in self.model.peft_config.values():
            config.base_model_name_or_path = public_name(base_name)
            config.revision = self.base_init_kwargs.get("revision")

    # ------------------------------------------------------------------------------------------------------------
    # Construction

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer: object, agents: Sequence[str], **options: Any) -> Policy:
        """Wrap an in-memory model (tests, notebooks); `options` as for the constructor. `base_name`: how to
        reload the base later; None makes `save` store the base weights inside the checkpoint."""
        return cls(model, tokenizer, agents, **options)

    @classmethod
    def from_config(
        cls,
        cfg: object,
        agents: Sequence[str],
        seed: int = 0,
        generation_batch_size: int = 16,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> Policy:
        """Load `cfg.name` (a `mappa.config.ModelConfig`, with its `init_kwargs`) and attach one set of weights
        per agent; prompts are templated with `chat_template_kwargs` (`generation.chat_template_kwargs`)."""
        from mappa.models import load_base_model

        model, tokenizer = load_base_model(cfg.name, device=cfg.device, dtype=cfg.dtype, init_kwargs=cfg.init_kwargs)
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
            base_init_kwargs=cfg.init_kwargs,
            chat_template_kwargs=chat_template_kwargs,
            generation_batch_size=generation_batch_size,
            seed=seed,
        )
        if cfg.gradient_checkpointing:
            policy.enable_gradient_checkpointing()
        return policy

    @classmethod
    def from_checkpoint(
        cls,
        directory: str | Path,
        device: str | torch.device = "auto",
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> Policy:
        """Rebuild a policy saved with `save`: base model (loaded with the init_kwargs it was trained with), agents,
        mode, LoRA settings and weights; prompts are templated with `chat_template_kwargs`."""
        from mappa.models import load_base_model

        directory = Path(directory)
        manifest = _read_manifest(directory)
        base = str(directory / "base") if manifest["base_name"] is None else manifest["base_name"]
        init_kwargs = manifest.get("init_kwargs") or {}  # checkpoints before model.init_kwargs have none
        model, tokenizer = load_base_model(base, device=device, init_kwargs=init_kwargs)
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
            base_init_kwargs=init_kwargs,
            chat_template_kwargs=chat_template_kwargs,
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

    def shardable_modules(self) -> list[torch.nn.Module]:
        """Every model this policy holds, for `mappa.sharding` to shard: the base (with the adapters) and,
        with `full` weights, each agent's copy."""
        return [self.model, *self._copies.values()]

    @contextmanager
    def active(self, agent: str | None) -> Iterator[torch.nn.Module]:
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

    def chat_ids(self, messages: Sequence[Message], template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Chat-template `messages` and append the assistant generation prompt; the template's variables are the
        policy's `chat_template_kwargs`, updated with `template_kwargs` (a served request's own)."""
        text = self.tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages], add_generation_prompt=True, tokenize=False,
            **{**self.chat_template_kwargs, **(template_kwargs or {})},
        )  # fmt: skip
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
        sampling = Sampling(temperature, top_p, seeded_generator(seed, self.device))
        with torch.no_grad(), self.active(agent) as module:
            for start in range(0, len(order), size):
                rows = [DecodeRow(i, prompts[i], max_new_tokens, top_logprobs) for i in order[start : start + size]]
                for i, gen in self._decode(module, rows, sampling):
                    out[i] = gen
        return out  # type: ignore[return-value]

    def _decode(
        self, module: torch.nn.Module, rows: list[DecodeRow], sampling: Sampling
    ) -> list[tuple[Any, Generation]]:
        """Prefill the rows' prompts, then one forward per token until every row has stopped.

        A finished row leaves the batch (and the cache); the cache grows by one column per step. The
        serving package's decoder also lets rows join mid-batch and writes into reserved room instead.
        """
        cache, logits, attn, pos = prefill(module, [r.prompt for r in rows], self.pad_id)
        eos = frozenset(self.eos_ids)
        done: list[tuple[Any, Generation]] = []
        while True:
            tok, finished, keep = sample_step(rows, logits, sampling, eos, self.tokenizer)
            done += finished
            if not keep:
                return done
            if len(keep) < len(rows):
                idx = torch.tensor(keep, device=attn.device)
                rows = [rows[j] for j in keep]
                cache.batch_select_indices(idx)
                attn, pos, tok = attn[idx], pos[idx], tok[idx]
            attn = torch.cat([attn, attn.new_ones(len(rows), 1)], dim=1)
            out = module(
                input_ids=tok[:, None],
                attention_mask=attn,
                position_ids=pos[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            cache, logits, pos = out.past_key_values, out.logits[:, -1].float(), pos + 1

    # ------------------------------------------------------------------------------------------------------------
    # Logprobs for training

    def forward_logprobs(
        self,
        agent: str | None,
        prompt_ids: Sequence[Sequence[int]],
        response_ids: Sequence[Sequence[int]],
        *,
        temperature: float = 1.0,
        entropy: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """Per-token log pi(response | prompt) for one micro-batch: (logp (B, T), mask (B, T)), right-padded
        over responses (padded entries are 0 with mask False). Differentiable w.r.t. the agent's weights
        when grad is enabled; the reference (None) never builds a graph. `temperature`: the one the
        responses were sampled at (`scaled_logits`), so these are the log-probs `generate` reported.
        `entropy`: also (B, T) the entropy of pi_T at each response position, from the same logits (no
        gradient; 0 where mask is False), as a third tensor.

        Layout: prompts left-padded to a common length so every response starts at the same column,
        which lets the LM head run on response positions only (logits_to_keep) instead of the prompt.
        """
        if len(prompt_ids) != len(response_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
        B = len(prompt_ids)
        T = max((len(r) for r in response_ids), default=0)
        if B == 0 or T == 0:
            empty = torch.zeros(B, T, device=self.device)
            return (empty, empty.bool(), empty) if entropy else (empty, empty.bool())
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
        with self.active(agent) as module:
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
        logits = scaled_logits(logits.float(), temperature)  # (B, T, V)
        targets = input_ids[:, P:]
        logz = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(-1, targets[..., None]).squeeze(-1) - logz
        if not entropy:
            return logp * mask, mask
        with torch.no_grad():  # H = log Z - E_pi[logit]: a metric, so no graph over (B, T, V)
            ent = logz - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        return logp * mask, mask, ent * mask

    @torch.no_grad()
    def sequence_logprobs(
        self,
        agent: str | None,
        prompt_ids: Sequence[Sequence[int]],
        response_ids: Sequence[Sequence[int]],
        *,
        micro_batch_size: int = 8,
        temperature: float = 1.0,
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
            lp, m = self.forward_logprobs(
                agent, [prompt_ids[i] for i in idx], [response_ids[i] for i in idx], temperature=temperature
            )
            rows = torch.tensor(idx, device=self.device)
            logp[rows, : lp.shape[1]] = lp
            mask[rows, : m.shape[1]] = m
        return logp, mask

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints

    def save(self, directory: str | Path, *, write: bool = True) -> None:
        """Write per-agent weights (LoRA adapters in peft format, or full copies as HF model dirs), the
        tokenizer and a manifest. The base is referenced by name, or stored under base/ when it has none.

        Sharded weights (`mappa.sharding`) are gathered first, a collective: every rank calls `save`, and all
        but the first with `write=False`."""
        from safetensors.torch import save_file

        with self._lock:
            files = self._weight_files()
        if not write:
            return
        directory = Path(directory)
        try:
            for sub, (state, config) in files.items():
                (directory / sub).mkdir(parents=True, exist_ok=True)
                save_file(state, directory / sub / _WEIGHT_FILES[sub.partition("/")[0]], metadata={"format": "pt"})
                config.save_pretrained(directory / sub)
            if self.base_name is None:
                self.tokenizer.save_pretrained(directory / "base")
            self.tokenizer.save_pretrained(directory / "tokenizer")
            manifest = {
                "format_version": FORMAT_VERSION,
                "base_name": self.base_name,
                "init_kwargs": self.base_init_kwargs,
                "agent_weights": self.agent_weights,
                "agents": list(self.agents),
                "adapters": self._adapter,
                "lora": self.lora,
            }
            (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        except OSError as e:
            raise MappaError(f"cannot write checkpoint {directory} ({e.strerror or e})") from None

    def _weight_files(self) -> dict[str, tuple[dict[str, torch.Tensor], Any]]:
        """What a checkpoint holds besides the tokenizer, whole and on the CPU: {subdirectory: (tensors, the
        config saved beside them)}: agents/<agent> (full copies) or adapters/<adapter>, and base/ when the base
        has no name to be reloaded by."""
        files = {}
        if self.agent_weights == "full":
            for agent, module in self._copies.items():
                files[f"agents/{agent}"] = (_untied(_host_state(module.state_dict()), module.config), module.config)
        else:
            from peft import get_peft_model_state_dict

            for adapter in dict.fromkeys(self._adapter.values()):
                # no embedding layers: peft would otherwise look the base up on the Hub to compare vocab sizes
                state = get_peft_model_state_dict(self.model, adapter_name=adapter, save_embedding_layers=False)
                files[f"adapters/{adapter}"] = (_host_state(state), self.model.peft_config[adapter])
        if self.base_name is None:
            base = self.model if self.agent_weights == "full" else self.model.get_base_model()
            state = {k.replace(".base_layer.", "."): v for k, v in base.state_dict().items() if ".lora_" not in k}
            files["base"] = (_untied(_host_state(state), base.config), base.config)
        return files

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
                    state = _laid_out(_load_safetensors(path, load_file), module.state_dict())
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
                    expected = {n for n, _ in self.model.named_parameters() if f".{adapter}." in n}
                    # peft's keys leave the adapter's name out: lora_A.weight stands for lora_A.<adapter>.weight
                    targets = {re.sub(r"\.(lora_\w+)\." + re.escape(adapter) + r"\.", r".\1.", n): p
                               for n, p in self.model.named_parameters() if n in expected}  # fmt: skip
                    state = _laid_out(_load_safetensors(path, load_file), targets)
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


# ----------------------------------------------------------------------------------------------------------------
# Decoding steps, shared with the serving package (which adds rows mid-batch, reserved KV room and a prefix cache)


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn: temperature 0 is greedy; `generator` seeds sampling (None: torch's global RNG)."""

    temperature: float = 1.0
    top_p: float = 1.0
    generator: torch.Generator | None = None


@dataclass
class DecodeRow:
    """One sequence being decoded: its prompt, cap, and the tokens sampled so far with their logprobs."""

    key: Any  # what the caller gets back with the finished Generation
    prompt: list[int]
    max_new_tokens: int
    top_k: int = 0  # top_logprobs kept per token
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[tuple[tuple[int, float], ...]] = field(default_factory=list)

    def generation(self, tokenizer: Any, stopped: bool) -> Generation:
        return Generation(
            prompt_ids=tuple(self.prompt),
            response_ids=tuple(self.tokens),
            logprobs=tuple(self.logprobs),
            text=tokenizer.decode(self.tokens, skip_special_tokens=True),
            truncated=not stopped,
            top_logprobs=tuple(self.tops) if self.top_k else None,
        )


def seeded_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def sample_step(
    rows: list[DecodeRow], logits: torch.Tensor, sampling: Sampling, eos: frozenset[int], tokenizer: Any
) -> tuple[torch.Tensor, list[tuple[Any, Generation]], list[int]]:
    """Sample one token for each row from its (B, V) float32 logits and record it in the row.

    Returns (the sampled tokens (B,), `(key, Generation)` of the rows that finished with this token (EOS or
    their own cap), indices of the rows still running). Logprobs (the sampled token's and the top ones) are
    those of the distribution sampled from: the logits at the sampling temperature (`scaled_logits`).
    """
    logp = torch.log_softmax(scaled_logits(logits, sampling.temperature), dim=-1)
    tok = _sample(logits, sampling.temperature, sampling.top_p, sampling.generator)
    tok_lp = logp.gather(1, tok[:, None]).squeeze(1)
    k = min(max(r.top_k for r in rows), logp.shape[-1])
    if k:
        top_v, top_i = (t.tolist() for t in logp.topk(k, dim=-1))
    finished: list[tuple[Any, Generation]] = []
    keep: list[int] = []
    for j, (row, t, lp) in enumerate(zip(rows, tok.tolist(), tok_lp.tolist(), strict=True)):
        row.tokens.append(t)
        row.logprobs.append(lp)
        if row.top_k:
            row.tops.append(tuple(zip(top_i[j][: row.top_k], top_v[j][: row.top_k], strict=True)))
        if t in eos or len(row.tokens) >= row.max_new_tokens:
            finished.append((row.key, row.generation(tokenizer, stopped=t in eos)))
        else:
            keep.append(j)
    return tok, finished, keep


def prefill(
    module: torch.nn.Module, prompts: list[list[int]], pad_id: int
) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the prompts through the model: (KV cache left-padded to the longest prompt, last-position
    logits (B, V) in float32, attention mask (B, L), next position id (B,)).

    Prompts of equal length go through together with no padding and no mask, which keeps attention
    on the fused causal kernel; their caches are then stitched into one left-padded cache. A padded
    prefill needs an explicit (B, 1, L, L) mask, which sends PyTorch's CPU attention to its unfused
    path: on ~1,500-token prompts one padded batch of 8 took 2.5x as long as 8 unpadded ones.
    Caches with other than plain dynamic layers (sliding windows) are padded the classic way.
    """
    from transformers.cache_utils import DynamicCache

    if min(len(p) for p in prompts) == 0:
        raise ValueError("empty prompt")
    device = next(module.parameters()).device
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(len(p), []).append(i)
    parts = []
    for length, idx in groups.items():
        ids = torch.tensor([prompts[i] for i in idx], dtype=torch.long, device=device)
        out = module(input_ids=ids, use_cache=True, logits_to_keep=1)
        if not plain_layers(out.past_key_values):
            return prefill_padded(module, prompts, pad_id)
        parts.append((torch.tensor(idx, device=device), length, out))
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    B, L = len(prompts), int(lengths.max())
    attn = (torch.arange(L, device=device)[None, :] >= (L - lengths)[:, None]).long()
    if len(parts) == 1:
        out = parts[0][2]
        return out.past_key_values, out.logits[:, -1].float(), attn, lengths
    logits = torch.empty(B, parts[0][2].logits.shape[-1], device=device)
    kv = []
    for n, layer in enumerate(parts[0][2].past_key_values.layers):
        keys = layer.keys.new_zeros(B, layer.keys.shape[1], L, layer.keys.shape[3])
        values = layer.values.new_zeros(B, layer.values.shape[1], L, layer.values.shape[3])
        for idx, length, out in parts:  # right-aligned: the padding (masked out) comes first
            keys[idx, :, L - length :] = out.past_key_values.layers[n].keys
            values[idx, :, L - length :] = out.past_key_values.layers[n].values
        kv.append((keys, values))
    for idx, _, out in parts:
        logits[idx] = out.logits[:, -1].float()
    return DynamicCache(ddp_cache_data=kv), logits, attn, lengths


def prefill_padded(
    module: torch.nn.Module, prompts: list[list[int]], pad_id: int
) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`prefill` with left padding and an attention mask, in one forward: for any cache type."""
    device = next(module.parameters()).device
    L = max(len(s) for s in prompts)
    input_ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    attn = torch.zeros(len(prompts), L, dtype=torch.long)
    for i, s in enumerate(prompts):
        if not s:
            raise ValueError("empty prompt")
        input_ids[i, L - len(s) :] = torch.tensor(s, dtype=torch.long)
        attn[i, L - len(s) :] = 1
    input_ids, attn = input_ids.to(device), attn.to(device)
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    out = module(input_ids=input_ids, attention_mask=attn, position_ids=position_ids, use_cache=True, logits_to_keep=1)
    return out.past_key_values, out.logits[:, -1].float(), attn, position_ids[:, -1] + 1


def plain_layers(cache: Any) -> bool:
    """Whether every cache layer is a plain DynamicLayer: (B, H, L, D) tensors rows can be padded into."""
    return all(type(layer) is DynamicLayer for layer in cache.layers)


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


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits of the distribution sampled at `temperature`: divided by it (as TRL and verl do for the loss),
    so log_softmax of the result is log pi_T. Temperature 0 (greedy) samples from no distribution: the raw
    logits stand in, which keeps the log-probs finite."""
    return logits / temperature if temperature > 0 and temperature != 1.0 else logits


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


def read_manifest(directory: str | Path) -> dict:
    """A checkpoint's `mappa_policy.json` (base name, agents, mode, LoRA settings), checked; MappaError if absent."""
    return _read_manifest(Path(directory))


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


_WEIGHT_FILES = {"agents": "model.safetensors", "base": "model.safetensors", "adapters": "adapter_model.safetensors"}


def _host_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict whole and on the CPU, in key order (a sharded tensor's gather is a collective)."""
    return {k: sharding.host(v) for k, v in state.items()}


def _laid_out(state: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Loaded tensors laid out as the weights they go into: this rank's shard where those are sharded (a
    tensor of another shape is left for `load_state_dict` to name in its error)."""
    return {
        k: sharding.like(targets[k], v) if k in targets and targets[k].shape == v.shape else v
        for k, v in state.items()
    }


def _untied(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """The LM head left out when it is the embeddings (safetensors refuses aliases; HF re-ties on load)."""
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def _tied_keys(module: torch.nn.Module) -> set[str]:
    return {"lm_head.weight"} if module.config.tie_word_embeddings else set()
