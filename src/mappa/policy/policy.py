"""The policy layer: one base model, one set of trainable weights per agent, batched generation, logprobs.

Agent weights (`agent_weights`):
- `lora` (default): one LoRA adapter per agent on one shared frozen base (peft multi-adapter);
- `full`: a separate full trainable copy of the base per agent;
- `shared`: one adapter used by every agent (the single-policy baseline).
In every mode the reference policy (`agent=None`) is the frozen base: adapters disabled for
`lora`/`shared` (no extra memory), the untouched base module for `full`. Each mode is an object of
`mappa.policy.weights`, which the policy calls under its lock.

Switching agents happens inside a lock, right before each forward, so a generation or a logprob
call always runs with the named agent's weights. Every adapter's parameters keep
`requires_grad=True` (peft would flip them on every switch); only the active adapter takes part in
a forward, so a backward pass reaches that agent's weights alone.

Logprobs from `generate` are those of the distribution sampled from (`mappa.policy.decoding.scaled_logits`), and
`forward_logprobs(..., temperature=T)` recomputes them for the update (PPO's ratio, the KL term): both use
left-padded prompts and explicit position ids, so the two agree to float32 rounding. On a CPU `generate` may
sample from copies with each adapter folded in instead (`sample_from_copies`, `mappa.policy.sampling_copies`).

The decoding steps `generate` runs live in `mappa.policy.decoding`, shared with `mappa.serving` (which builds
continuous batching on them and on this module's `active`; training never imports it). The checkpoint
format `save`, `load_weights` and `from_checkpoint` read and write lives in `mappa.policy.storage`.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

import torch

from mappa.errors import MappaError
from mappa.policy import decoding, sampling_copies, storage
from mappa.policy.decoding import Generation
from mappa.policy.lora import DEFAULT_TARGET_MODULES, LoraSettings
from mappa.policy.models import chat_prompt_ids, load_base_model, portable_init_kwargs
from mappa.policy.storage import Manifest
from mappa.policy.weights import AdapterWeights, FullWeights
from mappa.protocols import row_seeds
from mappa.types import Message

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from mappa.config import ModelConfig

AGENT_WEIGHTS = ("lora", "full", "shared")


class PolicyOptions(TypedDict, total=False):
    """The constructor's keyword arguments, for `Policy.from_model`."""

    agent_weights: str  # one of AGENT_WEIGHTS
    lora_r: int
    lora_alpha: int
    lora_dropout: float
    target_modules: Sequence[str]
    base_name: str | None
    base_init_kwargs: Mapping[str, Any] | None
    chat_template_kwargs: Mapping[str, Any] | None
    generation_batch_size: int
    seed: int


class Policy:
    """A base causal LM plus one set of trainable weights per agent (see the module docstring)."""

    model: torch.nn.Module  # the base; a peft model holding every adapter in `lora`/`shared` mode

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
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
        self.lora = LoraSettings(r=lora_r, alpha=lora_alpha, dropout=lora_dropout, target_modules=list(target_modules))
        self.device = next(model.parameters()).device
        self._lock = threading.RLock()
        self._sampling: sampling_copies.SamplingCopies | None = None  # `sample_from_copies`
        self._sampler_params: dict[str | None, list[torch.nn.Parameter]] = {}  # `sampler`
        self.eos_ids = decoding.eos_ids(tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]

        model.eval()
        model.requires_grad_(False)
        # LoRA A matrices (and full copies, which start equal to the base) are drawn from the seed so a
        # run is reproducible; fork_rng leaves the caller's global RNG untouched.
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed)
            if agent_weights == "full":
                self._weights: FullWeights | AdapterWeights = FullWeights(model, agents)
            else:
                revision = self.base_init_kwargs.get("revision")
                shared = agent_weights == "shared"
                self._weights = AdapterWeights(
                    model, agents, self.lora, shared=shared, base_name=base_name, revision=revision
                )
        self.model = self._weights.model

    # ------------------------------------------------------------------------------------------------------------
    # Construction

    @classmethod
    def from_model(
        cls, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, agents: Sequence[str],
        **options: Unpack[PolicyOptions],
    ) -> Policy:  # fmt: skip
        """Wrap an in-memory model (tests, notebooks); `options` as for the constructor. `base_name`: how to
        reload the base later; None makes `save` store the base weights inside the checkpoint."""
        return cls(model, tokenizer, agents, **options)

    @classmethod
    def from_config(
        cls,
        cfg: ModelConfig,
        agents: Sequence[str],
        seed: int = 0,
        generation_batch_size: int = 16,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> Policy:
        """Load `cfg.name` (with its `init_kwargs`) and attach one set of weights per agent; prompts are
        templated with `chat_template_kwargs` (`generation.chat_template_kwargs`)."""
        model, tokenizer = load_base_model(cfg.name, device=cfg.device, dtype=cfg.dtype, init_kwargs=cfg.init_kwargs)
        policy = cls(
            model, tokenizer, agents, agent_weights=cfg.agent_weights, lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout, target_modules=cfg.lora_target_modules, base_name=cfg.name,
            base_init_kwargs=cfg.init_kwargs, chat_template_kwargs=chat_template_kwargs,
            generation_batch_size=generation_batch_size, seed=seed,
        )  # fmt: skip
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
        directory = Path(directory)
        manifest = storage.read_manifest(directory)
        init_kwargs = manifest.get("init_kwargs") or {}  # checkpoints before model.init_kwargs have none
        base = storage.base_source(directory, manifest)
        model, tokenizer = load_base_model(base, device=device, init_kwargs=init_kwargs)
        lora = manifest["lora"]
        policy = cls(
            model, tokenizer, manifest["agents"], agent_weights=manifest["agent_weights"], lora_r=lora["r"],
            lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], target_modules=lora["target_modules"],
            base_name=manifest["base_name"], base_init_kwargs=init_kwargs, chat_template_kwargs=chat_template_kwargs,
        )  # fmt: skip
        policy.load_weights(directory)
        return policy

    def enable_gradient_checkpointing(self) -> None:
        """Recompute activations in backward. The recomputation runs with whichever agent is active at
        backward time, so call backward before the next agent's forward (the natural per-agent loop)."""
        for module in self._weights.modules():
            # non-reentrant checkpointing needs no input that requires grad (the base embeddings are frozen)
            module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self._checkpointing = True

    _checkpointing = False

    # ------------------------------------------------------------------------------------------------------------
    # Agents and weights

    def trainable_parameters(self, agent: str) -> list[torch.nn.Parameter]:
        """Only `agent`'s weights: its LoRA matrices (the one shared adapter in `shared` mode) or its full copy."""
        self._check_agent(agent)
        return self._weights.trainable_parameters(agent)

    def _check_agent(self, agent: str) -> None:
        if agent not in self.agents:
            raise MappaError(f"policy: unknown agent {agent!r} (agents: {', '.join(self.agents)})")

    @property
    def _adapter(self) -> dict[str, str]:
        """agent -> its peft adapter (`lora`/`shared`; empty for `full`)."""
        return self._weights.adapter

    def shardable_modules(self) -> list[torch.nn.Module]:
        """Every model this policy holds, for `mappa.policy.sharding` to shard: the base (with the adapters) and,
        with `full` weights, each agent's copy."""
        return list(dict.fromkeys([self.model, *self._weights.modules()]))

    @contextmanager
    def active(self, agent: str | None) -> Iterator[torch.nn.Module]:
        """The module to call for `agent` (None: the reference), with that agent's weights switched on for
        the duration. Held under a lock so concurrent callers cannot switch adapters mid-forward."""
        if agent is not None:
            self._check_agent(agent)
        with self._lock, self._weights.active(agent) as module:
            yield module

    def sample_from_copies(self, dtype: torch.dtype | None) -> None:
        """Have `generate` sample from a copy of each agent's weights with its adapter folded in, in `dtype`
        (`mappa.policy.sampling_copies`; None: through the training modules). The copies are made at the first use."""
        with self._lock:
            self.sampling_dtype, self._sampling = dtype, None

    sampling_dtype: torch.dtype | None = None  # what `generate` samples in when it samples from copies

    @property
    def samples_exactly(self) -> bool:
        """Whether `generate`'s log-probs are this policy's forward pass's (through the training modules, or a
        copy in the weights' own dtype): if not, an update recomputes the old log-probs (`mappa.training.update`)."""
        weights = next(self.model.parameters()).dtype
        return self.sampling_dtype is None or self.sampling_dtype == weights

    @contextmanager
    def sampler(self, agent: str | None) -> Iterator[torch.nn.Module]:
        """What `generate` runs: `agent`'s sampling copy, refilled if its weights changed, else `active`."""
        if self.sampling_dtype is None:
            with self.active(agent) as module:
                yield module
            return
        # The parameter list, not its values, is cached: walking the model's parameters for it cost 9% of a decode
        # step; the fingerprint below still reads every tensor's version, so any write is seen. Sampling copies
        # exist only for unsharded weights, whose parameter objects change only when files are loaded (`load`).
        if agent not in self._sampler_params:
            self._sampler_params[agent] = self.trainable_parameters(agent) if agent is not None else []
        params = self._sampler_params[agent]
        key = self._weights.sampling_key(agent)
        with self._lock:
            if self._sampling is None:
                self._sampling = sampling_copies.SamplingCopies(self._weights.sampling_base(), self.sampling_dtype)
            yield self._sampling.get(key, sampling_copies.fingerprint(params), lambda m: self._weights.fill(m, key))

    # ------------------------------------------------------------------------------------------------------------
    # Tokens

    def chat_ids(self, messages: Sequence[Message], template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Chat-template `messages` and append the assistant generation prompt; the template's variables are the
        policy's `chat_template_kwargs`, updated with `template_kwargs` (a served request's own)."""
        return chat_prompt_ids(self.tokenizer, messages, {**self.chat_template_kwargs, **(template_kwargs or {})})

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
        seed: int | Sequence[int] | None = None,
        batch_size: int | None = None,
    ) -> list[Generation]:
        """Sample one response per conversation with `agent`'s weights (None: the reference).

        Conversations are sorted by prompt length and run in batches of `batch_size` (default: the policy's
        `generation_batch_size`) with a KV cache; each sequence stops at its own EOS (the tokenizer's EOS or
        <|im_end|>), finished rows leave the batch. Results come back in input order. temperature 0 is greedy. A
        prompt longer than `max_context_tokens` raises MappaError (prompts are never silently cut: the agent would
        act on a context it never saw). `seed` (one per conversation, or one for the call: `row_seeds`) makes
        sampling reproducible without the global RNG; each conversation draws from its own generator, so its tokens
        do not depend on what else is in the call.
        """
        if max_new_tokens < 1:
            raise MappaError(f"generation.max_new_tokens must be >= 1 (got {max_new_tokens})")
        prompts = [self.chat_ids(c) for c in conversations]
        decoding.check_context(prompts, max_context_tokens, agent or "reference")
        batches = decoding.length_batches([len(p) for p in prompts], batch_size or self.generation_batch_size)
        sampling = decoding.Sampling(temperature, top_p)
        gens = [decoding.seeded_generator(s, self.device) for s in row_seeds(seed, len(prompts))]
        done: dict[Hashable, Generation] = {}
        with torch.no_grad(), self.sampler(agent) as module:
            for batch in batches:
                rows = [
                    decoding.DecodeRow(i, prompts[i], max_new_tokens, top_logprobs, generator=gens[i]) for i in batch
                ]
                done.update(decoding.decode(module, rows, sampling, self.pad_id, self.eos_ids, self.tokenizer))
        return [done[i] for i in range(len(prompts))]

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
        sampler: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """Per-token log pi(response | prompt) for one micro-batch: (logp (B, T), mask (B, T)), right-padded
        over responses (padded entries are 0 with mask False). Differentiable w.r.t. the agent's weights
        when grad is enabled; the reference (None) never builds a graph. `temperature`: the one the
        responses were sampled at (`mappa.policy.decoding.scaled_logits`), so these are the log-probs `generate`
        reported. `entropy`: also (B, T) the entropy of pi_T at each response position, from the same logits
        (no gradient; 0 where mask is False), as a third tensor. `sampler`: through what `generate` samples from
        (the agent's sampling copy, when it has one) instead of the training modules, without gradient.

        Layout (`mappa.policy.decoding.response_layout`): every response starts at the same column, which lets the
        LM head run on response positions only (logits_to_keep) instead of the prompt.
        """
        if len(prompt_ids) != len(response_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
        B = len(prompt_ids)
        T = max((len(r) for r in response_ids), default=0)
        if B == 0 or T == 0:
            empty = torch.zeros(B, T, device=self.device)
            return (empty, empty.bool(), empty) if entropy else (empty, empty.bool())
        input_ids, attn, position_ids, mask = decoding.response_layout(
            prompt_ids, response_ids, self.pad_id, self.device
        )
        train_mode = self._checkpointing and torch.is_grad_enabled() and agent is not None and not sampler
        with self.sampler(agent) if sampler else self.active(agent) as module:
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
        logp, ent = decoding.token_logprobs(logits.float(), input_ids[:, -T:], temperature, entropy=entropy)
        return (logp * mask, mask, ent * mask) if ent is not None else (logp * mask, mask)

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
        for idx in decoding.length_batches(
            [len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True)], micro_batch_size
        ):
            lp, m = self.forward_logprobs(
                agent, [prompt_ids[i] for i in idx], [response_ids[i] for i in idx], temperature=temperature
            )
            rows = torch.tensor(idx, device=self.device)
            logp[rows, : lp.shape[1]] = lp
            mask[rows, : m.shape[1]] = m
        return logp, mask

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints (the files: `mappa.policy.storage`)

    def save(self, directory: str | Path, *, write: bool = True) -> None:
        """Write per-agent weights (LoRA adapters in peft format, or full copies as HF model dirs), the
        tokenizer and a manifest. The base is referenced by name, or stored under base/ when it has none.

        Sharded weights (`mappa.policy.sharding`) are gathered first, a collective: every rank calls `save`, and all
        but the first with `write=False`."""
        with self._lock:
            files = self._weights.files(with_base=self.base_name is None)
        if write:
            storage.write_checkpoint(directory, files, self.tokenizer, self.manifest())

    def manifest(self) -> Manifest:
        """What `save` records beside the weights (`mappa_policy.json`)."""
        return Manifest(
            base_name=self.base_name,
            init_kwargs=self.base_init_kwargs,
            agent_weights=self.agent_weights,
            agents=list(self.agents),
            adapters=self._adapter,
            lora=self.lora,
        )

    def load_weights(self, directory: str | Path) -> None:
        """Load per-agent weights saved by `save` into this policy (same agents and mode)."""
        directory = Path(directory)
        storage.check_fits(directory, storage.read_manifest(directory), self.agents, self.agent_weights)
        with self._lock:
            self._weights.load(directory)
            self._sampler_params.clear()
