"""A local model as a continuously batched chat engine: what `mappa serve` runs.

Requests go to one worker thread that runs a `mappa.serving.decoder.Decoder`. Requests that can share a batch
(same agent, temperature, top-p and seed) join the running batch between decode steps and leave it
as soon as they finish, so nobody waits for a batch to fill or for the slowest reply in it, and a
follow-up request sent while others are still generating joins them at the next token. Requests
with other settings wait until the running batch drains (it takes no newcomers while they wait).
Prompt KV is kept in a `mappa.serving.prefix_cache.PrefixCache`: a follow-up that repeats an earlier request, or
a prompt that shares its opening with one, prefills only what is new.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from mappa.models import load_base_model
from mappa.policy import Generation, Policy
from mappa.serving.decoder import Decoder, decoding
from mappa.serving.prefix_cache import PrefixCache
from mappa.types import Message

PLACEHOLDER_AGENT = "base"  # the policy needs one agent; a plain model is served with adapters disabled


def load_policy(model: str, adapters: str | None = None) -> Policy:
    """A `mappa.policy.Policy` for serving or coaching: a checkpoint's agents, or a plain base model.

    `model` is a name `mappa.models.load_base_model` understands (`tiny-random` included).
    """
    if adapters:
        return Policy.from_checkpoint(adapters)
    base, tokenizer = load_base_model(model)
    return Policy.from_model(base, tokenizer, [PLACEHOLDER_AGENT], base_name=model)


@dataclass(frozen=True)
class ChatRequest:
    agent: str | None  # None: the base model (adapters disabled)
    messages: tuple[Message, ...]
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    top_logprobs: int = 0
    seed: int | None = None

    def group_key(self) -> tuple:
        """Requests with equal keys can decode in one batch (token caps and top-k are per row)."""
        return (self.agent, self.temperature, self.top_p, self.seed)


@dataclass
class _Pending:
    request: ChatRequest
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


_STOP = object()


class ChatEngine:
    """Continuous batching of concurrent `chat` calls over one policy (see the module docstring).

    Counters (read by `mappa serve`'s /stats): requests answered, prefill calls, decode steps, rows
    decoded summed over steps (`row_steps / steps` is the mean batch), largest batch, batches run,
    the worker's seconds in prefill and in decoding (against wall time: how busy the model is), and
    prefix-cache hits with the prompt tokens they saved from prefill.
    """

    def __init__(self, policy: Policy, max_batch: int = 16, prefix_cache_mib: float = 512) -> None:
        self.policy = policy
        self.max_batch = max_batch
        # Served and coaching weights do not change, so prompt KV can be reused across requests.
        self.prefix_cache = PrefixCache(int(prefix_cache_mib * 2**20)) if prefix_cache_mib > 0 else None
        self.requests = 0
        self.prefills = 0
        self.steps = 0
        self.row_steps = 0
        self.largest_batch = 0
        self.batches = 0  # decoding runs: a run lasts while at least one row is generating
        self.prefill_s = 0.0  # worker time spent prefilling prompts
        self.decode_s = 0.0  # worker time spent in decode steps
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = False  # set by a stop request; the worker exits once the running batch is done
        self._start_lock = threading.Lock()
        self._token_text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.policy.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def stats(self) -> dict[str, float]:
        return {
            "requests": self.requests,
            "batches": self.batches,
            "prefills": self.prefills,
            "steps": self.steps,
            "row_steps": self.row_steps,
            "mean_batch": round(self.row_steps / self.steps, 3) if self.steps else 0.0,
            "largest_batch": self.largest_batch,
            "prefill_s": round(self.prefill_s, 3),
            "decode_s": round(self.decode_s, 3),
            "prefix_hits": self.prefix_cache.hits if self.prefix_cache else 0,
            "prefix_tokens_reused": self.prefix_cache.tokens_reused if self.prefix_cache else 0,
        }

    async def chat(self, request: ChatRequest) -> Generation:
        """One response, decoded in a batch with whatever else is running."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="mappa-chat-engine", daemon=True)
                self._thread.start()
        self._inbox.put(_Pending(request, loop, future))
        return await future

    async def aclose(self) -> None:
        """Stop the worker after the running batch; requests still waiting get an error."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._inbox.put(_STOP)
            await asyncio.to_thread(thread.join)
        self._thread = None

    # ------------------------------------------------------------------------------------------------------------
    # Worker thread

    def _run(self) -> None:
        waiting: deque[_Pending] = deque()
        self._stopping = False
        while not self._stopping:
            if not waiting:
                item = self._inbox.get()
                if item is _STOP:
                    break
                waiting.append(item)
            self._collect(waiting)
            if not self._stopping:
                self._decode(waiting)
        for p in waiting:
            _settle(p, error=RuntimeError("the chat engine was closed"))

    def _collect(self, waiting: deque[_Pending]) -> None:
        """Move everything in the inbox to `waiting` without blocking (a stop request sets `_stopping`)."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is _STOP:
                self._stopping = True
            else:
                waiting.append(item)

    def _decode(self, waiting: deque[_Pending]) -> None:
        """Run one batch for the settings of the oldest waiting request until its last row finishes."""
        first = waiting[0].request
        key = first.group_key()
        running: dict[int, _Pending] = {}
        opened = False
        self.batches += 1
        try:
            with decoding(
                self.policy,
                first.agent,
                temperature=first.temperature,
                top_p=first.top_p,
                seed=first.seed,
                prefix_cache=self.prefix_cache,
            ) as decoder:
                opened = True
                self._admit(decoder, key, waiting, running)
                while len(decoder):
                    self.steps += 1
                    self.row_steps += len(decoder)
                    self.largest_batch = max(self.largest_batch, len(decoder))
                    t0 = time.perf_counter()
                    finished = decoder.step()
                    self.decode_s += time.perf_counter() - t0
                    for rid, gen in finished:
                        self.requests += 1
                        _settle(running.pop(rid), result=gen)
                    self._collect(waiting)
                    # Newcomers join only while no request with other settings is waiting (no starvation).
                    if decoder.can_add and all(p.request.group_key() == key for p in waiting):
                        self._admit(decoder, key, waiting, running)
        except Exception as e:  # noqa: BLE001 - delivered to each caller; the worker keeps serving
            failed = list(running.values())
            if not opened:  # these settings cannot decode at all (e.g. an unknown agent)
                failed += [p for p in waiting if p.request.group_key() == key]
                for p in failed:
                    if p in waiting:
                        waiting.remove(p)
            for p in failed:
                _settle(p, error=e)

    def _admit(self, decoder: Decoder, key: tuple, waiting: deque[_Pending], running: dict[int, _Pending]) -> None:
        """Tokenize and add waiting requests with `key` while the batch has room."""
        room = self.max_batch - len(decoder)
        chosen: list[_Pending] = []
        for p in list(waiting):
            if len(chosen) >= room:
                break
            if p.request.group_key() == key:
                waiting.remove(p)
                if not p.future.done():  # the client went away
                    chosen.append(p)
        # Same token cap and top-k go in one `add` (one prefill per prompt length within it).
        by_shape: dict[tuple[int, int], list[tuple[_Pending, list[int]]]] = {}
        for p in chosen:
            try:
                ids = self.policy.chat_ids(p.request.messages)
            except Exception as e:  # noqa: BLE001 - e.g. a chat template that refuses the roles given
                _settle(p, error=e)
                continue
            by_shape.setdefault((p.request.max_tokens, p.request.top_logprobs), []).append((p, ids))
        for (max_tokens, top_k), members in by_shape.items():
            keys = [id(p) for p, _ in members]
            t0 = time.perf_counter()
            try:
                decoder.add([ids for _, ids in members], max_tokens, keys=keys, top_logprobs=top_k)
            except Exception as e:  # noqa: BLE001 - these requests fail; the running rows carry on
                for p, _ in members:
                    _settle(p, error=e)
                continue
            self.prefills += 1
            self.prefill_s += time.perf_counter() - t0
            running.update(zip(keys, (p for p, _ in members), strict=True))


def _settle(p: _Pending, result: Any = None, error: BaseException | None = None) -> None:
    """Complete a caller's future from the worker thread (no-op when the caller is gone)."""

    def done() -> None:
        if not p.future.done():
            if error is not None:
                p.future.set_exception(error)
            else:
                p.future.set_result(result)

    try:
        p.loop.call_soon_threadsafe(done)
    except RuntimeError:  # the caller's event loop is closed
        pass
