"""A local model as a continuously batched chat engine: what `mappa serve` runs, and what episodes sample from.

Requests go to one worker thread that runs a `mappa.policy.decoder.Decoder`. Requests that can share a batch
(same model, temperature and top-p; a request's seed gives its row a sampler of its own) join the running
batch between decode steps and leave it as soon as they finish, so nobody waits for a batch to fill or for
the slowest reply in it, and a follow-up request sent while others are still generating joins them at the
next token. Requests with other settings wait until the running batch drains (it takes no newcomers while
they wait). Prompt KV is kept in a `mappa.policy.prefix_cache.PrefixCache`: a follow-up that repeats an
earlier request, or a prompt that shares its opening with one, prefills only what is new.

`chat_stream` yields a request's tokens as they are sampled (for server-sent events); `run` executes a
function on the worker between batches (loading or unloading an adapter changes the model's modules).
A caller that stops waiting (its client hung up: the awaiting task is cancelled, or the stream closed) has its
row taken out of the batch before the next decode step, so its KV room goes to others.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mappa.policy.decoder import Decoder, decoding
from mappa.policy.decoding import DecodeRow, Generation, Sampling, seeded_generator
from mappa.policy.models import load_base_model
from mappa.policy.policy import Policy
from mappa.policy.prefix_cache import PrefixCache
from mappa.policy.sampling_copies import fingerprint
from mappa.types import Message

PLACEHOLDER_AGENT = "base"  # the policy needs one agent; a plain model is served with adapters disabled


def load_policy(model: str, adapters: str | None = None) -> Policy:
    """A `mappa.policy.policy.Policy` for serving or coaching: a checkpoint's agents, or a plain base model.

    `model` is a name `mappa.policy.models.load_base_model` understands (`tiny-random` included).
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
    prompt_ids: tuple[int, ...] | None = None  # the chat-templated prompt, when the caller tokenized it already

    def group_key(self) -> tuple:
        """Requests with equal keys can decode in one batch (token caps, top-k and seeds are per row)."""
        return (self.agent, self.temperature, self.top_p)


@dataclass
class _Pending:
    request: ChatRequest
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    on_tokens: Callable[[list[int], list[float], list[Any]], None] | None = None  # streaming: called on the loop
    sent: int = 0  # tokens already streamed

    def ready(self, key: tuple) -> bool:
        return self.request.group_key() == key


@dataclass
class _Command:
    """A function to run on the worker between batches (`ChatEngine.run`)."""

    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future = field(repr=False)

    def ready(self, key: tuple) -> bool:
        return False  # never joins a batch; the running one takes no newcomers while it waits


_STOP = object()
MAX_IDLE = 256  # steps a decoder with rows may wait while another drains (`ChatEngine._interleave`)


@dataclass
class _Live:
    """One setting's decoder while `ChatEngine._interleave` runs, the requests in it, and the steps it waited."""

    agent: str | None
    decoder: Decoder
    running: dict[int, _Pending] = field(default_factory=dict)
    idle: int = 0


class ChatEngine:
    """Continuous batching of concurrent `chat` calls over one policy (see the module docstring).

    Counters (read by `mappa serve`'s /stats): requests answered, prefill calls, decode steps, rows
    decoded summed over steps (`row_steps / steps` is the mean batch), largest batch, batches run,
    the worker's seconds in prefill and in decoding (against wall time: how busy the model is),
    prefix-cache hits with the prompt tokens they saved from prefill, rows dropped because their caller
    went away (`cancelled`), and the rows decoding now (`active_rows`).
    """

    def __init__(
        self, policy: Policy, max_batch: int = 16, prefix_cache_mib: float = 512, *, sampler: bool = False,
        interleave: bool = False,
    ) -> None:  # fmt: skip
        # `policy`: a Policy, or anything with its decoding interface (`mappa.serving.adapters.ServedPolicy`).
        # `sampler`: decode from the policy's sampling copies (`Policy.sampler`), as training episodes do.
        # `interleave`: one decoder per setting alive at once (`_interleave`), for many agents' requests at once.
        self.policy = policy
        self.max_batch = max_batch
        self.sampler = sampler
        self.interleave = interleave
        self._params: dict[str | None, list[torch.nn.Parameter]] = {}  # each agent's trainable weights (`_owner`)
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
        self.cancelled = 0  # rows taken out of a batch because their caller stopped waiting
        self.active_rows = 0  # rows in the running batch (0 between batches)
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
            "cancelled": self.cancelled,
            "active_rows": self.active_rows,
        }

    async def chat(self, request: ChatRequest) -> Generation:
        """One response, decoded in a batch with whatever else is running."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._submit(_Pending(request, loop, future))
        return await future

    async def chat_stream(self, request: ChatRequest) -> AsyncIterator[tuple[list[int], list[float], list[Any]]]:
        """`chat`, yielding (token ids, logprobs, top logprobs) as the tokens are sampled; the last item is the
        whole Generation (`isinstance(item, Generation)`), whose tokens include those not yielded before."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        chunks: asyncio.Queue = asyncio.Queue()
        future.add_done_callback(lambda _: chunks.put_nowait(None))  # after every chunk queued before it
        self._submit(_Pending(request, loop, future, on_tokens=lambda *chunk: chunks.put_nowait(chunk)))
        try:
            while (chunk := await chunks.get()) is not None:
                yield chunk
            yield future.result()
        finally:
            future.cancel()  # the client went away: its row is not admitted any more

    async def run(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the worker thread between batches (nothing decodes meanwhile); returns its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._submit(_Command(fn, loop, future))
        return await future

    def _submit(self, item: _Pending | _Command) -> None:
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="mappa-chat-engine", daemon=True)
                self._thread.start()
        self._inbox.put(item)

    async def aclose(self) -> None:
        """Stop the worker after the running batch; requests still waiting get an error."""
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """`aclose` from outside an event loop."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._inbox.put(_STOP)
            thread.join()
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
            if self._stopping:
                break
            if isinstance(waiting[0], _Command):
                self._command(waiting.popleft())
            elif self.interleave:
                self._interleave(waiting)
            else:
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

    def _command(self, c: _Command) -> None:
        try:
            result = c.fn()
        except Exception as e:  # noqa: BLE001 - delivered to the caller; the worker keeps serving
            _settle(c, error=e)
        else:
            _settle(c, result=result)

    def _decode(self, waiting: deque[_Pending | _Command]) -> None:
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
                prefix_cache=self.prefix_cache,
                sampler=self.sampler,
            ) as decoder:
                opened = True
                self._admit(decoder, key, waiting, running)
                self.active_rows = len(decoder)
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
                    self._drop_abandoned(decoder, running)
                    _stream(decoder.running(), running)
                    self._collect(waiting)
                    # Newcomers join only while nothing with other settings is waiting (no starvation).
                    if decoder.can_add and all(p.ready(key) for p in waiting):
                        self._admit(decoder, key, waiting, running)
                    self.active_rows = len(decoder)
        except Exception as e:  # noqa: BLE001 - delivered to each caller; the worker keeps serving
            failed = list(running.values())
            if not opened:  # these settings cannot decode at all (e.g. an unknown agent)
                failed += [p for p in waiting if p.ready(key)]
                for p in failed:
                    if p in waiting:
                        waiting.remove(p)
            for p in failed:
                _settle(p, error=e)
        finally:
            self.active_rows = 0

    def _owner(self, agent: str | None) -> Any:
        """Whose prompt KV a decoder keeps in the prefix cache: the agent, and, for weights that train (`sampler`),
        the state of its weights, so KV computed before an update is never reused after it."""
        if not self.sampler or self.prefix_cache is None:
            return agent
        if agent not in self._params:
            self._params[agent] = [] if agent is None else self.policy.trainable_parameters(agent)
        return (agent, fingerprint(self._params[agent]))

    def _module(self, agent: str | None) -> Any:
        return self.policy.sampler(agent) if self.sampler else self.policy.active(agent)

    def _interleave(self, waiting: deque[_Pending | _Command]) -> None:
        """Decoders for every setting waiting, alive at once: a request joins its own setting's decoder at the next
        step, whatever else runs; the steps go to one decoder until it drains (`_choose`). Runs until every decoder
        is empty; a command waiting stops the admissions until then."""
        live: dict[tuple, _Live] = {}
        current: _Live | None = None
        self.batches += 1
        try:
            while True:
                self._collect(waiting)
                self._admit_interleaved(waiting, live)
                busy = [d for d in live.values() if len(d.decoder)]
                self.active_rows = sum(len(d.decoder) for d in busy)
                if not busy:
                    break
                d = current = _choose(busy, current)
                for other in busy:
                    other.idle += 1
                d.idle = 0
                self._step(d)
        except Exception as e:  # noqa: BLE001 - delivered to each caller; the worker keeps serving
            for d in live.values():
                for p in d.running.values():
                    _settle(p, error=e)
        finally:
            self.active_rows = 0

    def _step(self, d: _Live) -> None:
        self.steps += 1
        self.row_steps += len(d.decoder)
        self.largest_batch = max(self.largest_batch, len(d.decoder))
        t0 = time.perf_counter()
        with torch.no_grad(), self._module(d.agent) as module:
            d.decoder.module = module
            finished = d.decoder.step()
        self.decode_s += time.perf_counter() - t0
        for rid, gen in finished:
            self.requests += 1
            _settle(d.running.pop(rid), result=gen)
        self._drop_abandoned(d.decoder, d.running)
        _stream(d.decoder.running(), d.running)

    def _admit_interleaved(self, waiting: deque[_Pending | _Command], live: dict[tuple, _Live]) -> None:
        """Every request waiting ahead of the first command into its setting's decoder (made when it has none),
        while that one has room; the command runs once the decoders are empty."""
        cut = next((i for i, p in enumerate(waiting) if isinstance(p, _Command)), len(waiting))
        ahead, behind = deque(list(waiting)[:cut]), list(waiting)[cut:]
        self._admit_each(ahead, live)
        waiting.clear()
        waiting.extend([*ahead, *behind])

    def _admit_each(self, waiting: deque[_Pending | _Command], live: dict[tuple, _Live]) -> None:
        for key in dict.fromkeys(p.request.group_key() for p in waiting):
            d = live.get(key)
            if d is None:
                first = next(p.request for p in waiting if p.ready(key))
                sampling = Sampling(first.temperature, first.top_p, seeded_generator(None, self.policy.device))
                owner = self._owner(first.agent)
                decoder = Decoder(self.policy, None, sampling, prefix_cache=self.prefix_cache, owner=owner)
                d = live[key] = _Live(first.agent, decoder)
            if not d.decoder.can_add:
                continue
            try:
                with torch.no_grad(), self._module(d.agent) as module:
                    d.decoder.module = module
                    self._admit(d.decoder, key, waiting, d.running)
            except Exception as e:  # noqa: BLE001 - these settings cannot decode (e.g. an unknown agent)
                for p in [p for p in waiting if p.ready(key)]:
                    waiting.remove(p)
                    _settle(p, error=e)

    def _drop_abandoned(self, decoder: Decoder, running: dict[int, _Pending]) -> None:
        """Take out the rows whose caller stopped waiting: a running row's future is only ever done early
        when it was cancelled (finished rows leave `running` as they are settled)."""
        gone = [rid for rid, p in running.items() if p.future.done()]
        if gone:
            decoder.drop(gone)
            for rid in gone:
                del running[rid]
            self.cancelled += len(gone)

    def _admit(
        self, decoder: Decoder, key: tuple, waiting: deque[_Pending | _Command], running: dict[int, _Pending]
    ) -> None:
        """Tokenize and add waiting requests with `key` while the batch has room."""
        room = self.max_batch - len(decoder)
        chosen: list[_Pending] = []
        for p in list(waiting):
            if len(chosen) >= room:
                break
            if p.ready(key):
                waiting.remove(p)
                if not p.future.done():  # the client went away
                    chosen.append(p)
        # Same token cap and top-k go in one `add` (one prefill per prompt length within it); seeds are per row.
        by_shape: dict[tuple[int, int], list[tuple[_Pending, list[int]]]] = {}
        for p in chosen:
            try:
                ids = list(p.request.prompt_ids or ()) or self.policy.chat_ids(p.request.messages)
            except Exception as e:  # noqa: BLE001 - e.g. a chat template that refuses the roles given
                _settle(p, error=e)
                continue
            by_shape.setdefault((p.request.max_tokens, p.request.top_logprobs), []).append((p, ids))
        for (max_tokens, top_k), members in by_shape.items():
            keys = [id(p) for p, _ in members]
            t0 = time.perf_counter()
            try:
                seeds = [p.request.seed for p, _ in members]
                decoder.add([ids for _, ids in members], max_tokens, keys=keys, top_logprobs=top_k, seeds=seeds)
            except Exception as e:  # noqa: BLE001 - these requests fail; the running rows carry on
                for p, _ in members:
                    _settle(p, error=e)
                continue
            self.prefills += 1
            self.prefill_s += time.perf_counter() - t0
            running.update(zip(keys, (p for p, _ in members), strict=True))


def _choose(busy: list[_Live], current: _Live | None) -> _Live:
    """The decoder the next step goes to: the one stepped last until it drains (its rows and the requests that join
    it), then the fullest; one that waited MAX_IDLE steps goes first. A step's cost barely grows with its rows (on
    a CPU a SmolLM2-135M step reads every weight whatever the batch), so what decides throughput is rows per step:
    stepping the fullest decoder each time split the episodes' rows among their agents' decoders (a mean batch of
    5 of 16 episodes: 0.71x the stage-by-stage batches' tokens/s at 256 tokens an action, 0.87x draining;
    bench/bench_rollout.py), while draining one lets the others fill up meanwhile, as a stage-by-stage batch does,
    without holding an episode at a barrier."""
    starved = [d for d in busy if d.idle >= MAX_IDLE]
    if starved:
        return max(starved, key=lambda d: len(d.decoder))
    if any(d is current for d in busy):
        return current
    return max(busy, key=lambda d: len(d.decoder))


def _stream(rows: list[DecodeRow], running: dict[int, _Pending]) -> None:
    """Hand each streaming request the tokens sampled since the last call (on its own event loop)."""
    for row in rows:
        p = running.get(row.key)
        if p is None or p.on_tokens is None or len(row.tokens) <= p.sent:
            continue
        new = slice(p.sent, len(row.tokens))
        p.sent = len(row.tokens)
        chunk = (row.tokens[new], row.logprobs[new], row.tops[new])
        try:
            p.loop.call_soon_threadsafe(p.on_tokens, *chunk)
        except RuntimeError:  # the caller's event loop is closed
            pass


def _settle(p: _Pending | _Command, result: Any = None, error: BaseException | None = None) -> None:
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
