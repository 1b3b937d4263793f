"""`mappa serve`: an OpenAI-compatible HTTP server for a local base model, each trained agent, and LoRA adapters
loaded at run time.

Endpoints: `GET /v1/models`, `POST /v1/chat/completions` (messages, temperature, top_p, max_tokens,
logprobs, top_logprobs, seed, stream; `model` is the base name, an agent name from the checkpoint, or a
loaded adapter's name), `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (vLLM's bodies and
replies: `{"lora_name", "lora_path"}`, a plain-text "Success: ..." or an OpenAI-style error), plus
`GET /health` and `GET /stats` (batching counters). Requests for the same model and sampling settings are
batched continuously: a request joins the running batch at the next decode step and leaves it when its
reply is done (`mappa.policy.chat_engine.ChatEngine`). `stream=true` answers with server-sent events as the
OpenAI API does; vLLM's `return_token_ids` and `return_tokens_as_token_ids` are honoured
(`mappa.serving.api`), and so is `chat_template_kwargs` (the chat template's extra variables, e.g.
`enable_thinking`, over the served policy's own). Not supported: n > 1, stop sequences, tools, and every other
field that would change the reply (penalties, `response_format`, `chat_template`, ...); those are rejected with
HTTP 400 naming the field
rather than silently ignored, and so is a field the server does not know. Temperature 0 is greedy
decoding; a request's seed makes its sampling reproducible whatever it is batched with.

Limits (`mappa.serving.guard`): with an API key every path but `/health` needs `Authorization: Bearer KEY`
(401); a body over the size cap is a 413; a prompt that does not fit the model's context is a 400 before any
work, and `max_tokens` is clamped to the room the prompt leaves; adapters load only from under the adapter
roots, their files opened without following links and read from what was opened; at most
`max_loaded_adapters` are loaded (least recently used unloaded first); a client that hangs up has its row
taken out of the batch.

In-process use (tests, notebooks): `create_app(policy, base_name)` and `start_server(app)`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from mappa.errors import MappaError
from mappa.policy.chat_engine import ChatEngine, ChatRequest
from mappa.policy.policy import Policy
from mappa.serving.adapters import ServedPolicy
from mappa.serving.api import (
    ChatCompletionIn,
    LoadLoRAIn,
    UnloadLoRAIn,
    completion,
    stream_events,
    unsupported_field,
)
from mappa.serving.guard import AdapterRoots, APIKeyMiddleware, BodyLimitMiddleware
from mappa.types import Message

DEFAULT_CONTEXT = 4096  # for a model whose config names no context length


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


def _check_supported(req: ChatCompletionIn) -> None:
    unsupported = unsupported_field(req)
    if unsupported is not None:
        raise APIError(400, unsupported[1], param=unsupported[0])
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _messages(req: ChatCompletionIn) -> tuple[Message, ...]:
    out = []
    for i, m in enumerate(req.messages):
        role = _ROLES.get(m.role)
        if role is None:
            raise APIError(400, f"messages[{i}].role: unsupported role {m.role!r}", param=f"messages[{i}].role")
        if isinstance(m.content, list):
            content = "".join(p.text for p in m.content if p.type == "text")
        else:
            content = m.content or ""
        out.append(Message(role=role, content=content))
    return tuple(out)


@dataclass(frozen=True)
class Limits:
    """What `mappa serve` lets a client do (see the module docstring); the defaults are `mappa serve`'s."""

    api_key: str | None = None  # None or empty: no key asked (the CLI then listens on loopback only)
    adapter_roots: Sequence[str | os.PathLike] = ()  # none: runtime adapter loading is refused
    max_loaded_adapters: int = 16
    max_model_len: int | None = None  # prompt + reply tokens; None: the model's own context length
    max_body_mib: float = 8.0


def create_app(
    policy: Policy,
    base_name: str,
    agents: Sequence[str] | None = None,
    *,
    max_batch: int = 16,
    default_max_tokens: int = 256,
    prefix_cache_mib: float = 512,
    engine: ChatEngine | None = None,
    limits: Limits | None = None,
) -> FastAPI:
    """The FastAPI app serving `policy`: `base_name` is the base (adapters off), `agents` (default: the
    policy's agents) are served by name with their own weights, adapters loaded at run time by theirs.
    `engine`: anything with ChatEngine's `chat`, `token_text` and `stats` (default: a ChatEngine over the
    policy; benchmarks pass others; streaming and adapter loading need a ChatEngine). `limits`: the API key,
    adapter roots and size limits (`Limits`)."""
    limits = limits or Limits()
    agents = tuple(policy.agents if agents is None else agents)
    served = ServedPolicy(policy, base_name, agents, max_loaded=limits.max_loaded_adapters)
    if engine is None:
        engine = ChatEngine(served, max_batch=max_batch, prefix_cache_mib=prefix_cache_mib)
    context = context_length(policy, limits.max_model_len)
    app = FastAPI(title="mappa serve", docs_url=None, redoc_url=None)
    app.state.engine, app.state.served = engine, served
    _add_error_handlers(app)
    _add_info_routes(app, served, engine)
    _add_adapter_routes(app, served, engine, AdapterRoots(limits.adapter_roots))
    _add_chat_route(app, served, engine, default_max_tokens, context)
    app.add_middleware(BodyLimitMiddleware, max_bytes=int(limits.max_body_mib * 2**20))
    if limits.api_key:  # added last, so it runs first: nobody without the key gets further
        app.add_middleware(APIKeyMiddleware, api_key=limits.api_key)
    return app


def context_length(policy: Policy, max_model_len: int | None = None) -> int:
    """Tokens a prompt and its reply may hold together: `max_model_len` when given, else the model's nominal
    context (its config's `max_position_embeddings`). A longer `max_model_len` is allowed, as vLLM allows it on
    request: rotary positions run on past the nominal length, untrained (tiny test models need the room)."""
    if max_model_len is not None:
        if max_model_len < 2:
            raise MappaError(f"--max-model-len must be >= 2 (got {max_model_len})")
        return max_model_len
    config = getattr(policy.model, "config", None)
    for c in (getattr(config, "text_config", None), config):
        n = getattr(c, "max_position_embeddings", None)
        if isinstance(n, int) and n > 0:
            return n
    return DEFAULT_CONTEXT


def _add_chat_route(app: FastAPI, served: ServedPolicy, engine: Any, default_max_tokens: int, context: int) -> None:
    eos = frozenset(served.eos_ids)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionIn, http: Request) -> Any:
        request = _chat_request(req, served, default_max_tokens, context)
        if req.stream:
            # A client that hangs up cancels the stream; `chat_stream` then cancels its row.
            prompt = list(request.prompt_ids or ()) if req.return_token_ids else None
            events = stream_events(req, engine.chat_stream(request), served.tokenizer, engine, eos, prompt)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            gen = await _unless_disconnected(http, engine.chat(request))
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it; the row has left the batch
        except MappaError as e:
            raise APIError(400, str(e)) from None
        except Exception as e:  # noqa: BLE001 - reported to the client; the server keeps running
            raise APIError(500, f"generation failed: {type(e).__name__}: {e}", "server_error") from None
        # A JSONResponse skips FastAPI's jsonable_encoder, which took ~24 ms for 64 tokens with top-20
        # logprobs (json.dumps: 1.5 ms) on the event loop that every other request waits on.
        return JSONResponse(completion(req, gen, engine, eos))


class _ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """`await work`, cancelled when the client hangs up first (the engine then takes its row out): uvicorn does
    not cancel a handler whose client is gone, it only reports the disconnect to `receive`."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        raise _ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    # The body has been read: the next message the server has for this request is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _add_info_routes(app: FastAPI, served: ServedPolicy, engine: Any) -> None:
    created = int(time.time())

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/stats")
    async def stats() -> dict[str, float]:
        return engine.stats()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [{"id": n, "object": "model", "created": created, "owned_by": "mappa"} for n in served.names()]
        for entry in data:  # adapters loaded at run time name their base, as vLLM lists them
            if entry["id"] in served.loaded:
                entry.update(parent=served.base_name, root=served.loaded[entry["id"]][1])
        return {"object": "list", "data": data}


def _add_adapter_routes(app: FastAPI, served: ServedPolicy, engine: ChatEngine, roots: AdapterRoots) -> None:
    """vLLM's runtime LoRA endpoints. The change runs on the engine's worker between batches, and the
    name's cached prompt KV goes with the old weights (as does that of adapters unloaded to make room)."""

    def forget(name: str) -> None:
        if engine.prefix_cache is not None:
            engine.prefix_cache.forget(name)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAIn) -> PlainTextResponse:
        try:
            directory = roots.open(req.lora_path)
        except MappaError as e:
            raise APIError(400, str(e), param="lora_path") from None

        def load() -> None:
            for name in [req.lora_name, *served.load(req.lora_name, directory, replace=req.load_inplace)]:
                forget(name)

        # The files are read through the directory opened above: whatever replaces the path meanwhile is not read.
        try:
            await engine.run(load)
        except MappaError as e:
            raise APIError(400, str(e), param="lora_path") from None
        finally:
            directory.close()
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAIn) -> PlainTextResponse:
        def unload() -> None:
            served.unload(req.lora_name)
            forget(req.lora_name)

        try:
            await engine.run(unload)
        except KeyError:
            raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.", "NotFoundError") from None
        except MappaError as e:
            raise APIError(400, str(e), param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


def _add_error_handlers(app: FastAPI) -> None:
    """OpenAI-style error bodies for our own errors and for request validation."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return _error(e.status, e.message, e.type, e.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"] if p != "body")
        return _error(400, f"{loc}: {first['msg']}", param=loc or None)


def _chat_request(req: ChatCompletionIn, served: ServedPolicy, default_max_tokens: int, context: int) -> ChatRequest:
    """The engine request for a validated body: unsupported options, unknown models and prompts that do not fit
    the context are API errors; `max_tokens` is clamped to the room the prompt leaves."""
    _check_supported(req)
    try:
        agent = served.resolve(req.model)
    except KeyError:
        names = ", ".join(served.names())
        raise APIError(404, f"model {req.model!r} not found (served: {names})", "not_found_error", "model") from None
    messages = _messages(req)
    try:
        prompt = served.chat_ids(messages, req.chat_template_kwargs)
    except Exception as e:  # noqa: BLE001 - e.g. a chat template that refuses the roles given
        first = str(e).splitlines()[0][:200] if str(e) else ""
        raise APIError(
            400,
            f"messages: the chat template refused them ({type(e).__name__}: {first})",
            "invalid_request_error",
            "messages",
        ) from None
    room = context - len(prompt)
    if room < 1:
        raise APIError(
            400, f"messages: the prompt has {len(prompt)} tokens; the model's context is {context}", param="messages"
        )
    asked = req.max_completion_tokens or req.max_tokens or default_max_tokens
    return ChatRequest(
        agent=agent,
        messages=messages,
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=min(asked, room),
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
        seed=req.seed,
        prompt_ids=tuple(prompt),
    )


@dataclass
class RunningServer:
    """A uvicorn server running in a background thread (tests, benchmarks, notebooks)."""

    url: str  # base URL including /v1
    server: Any
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # asyncio only disables Nagle on sockets created with proto=IPPROTO_TCP; without it every response
    # (headers and body are two writes) waits ~40 ms for the client's delayed ACK. Accepted connections
    # inherit the option from the listening socket.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise MappaError(f"--host/--port: cannot listen on {host}:{port} ({e.strerror})") from None
    sock.listen(256)
    sock.set_inheritable(True)
    return sock


def start_server(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    """Serve `app` in a daemon thread on a socket bound before returning (port 0: a free port)."""
    import uvicorn

    sock = bind(host, port)
    bound_port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="mappa-serve", daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if not thread.is_alive() or time.time() > deadline:
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.01)
    return RunningServer(url=f"http://{host}:{bound_port}/v1", server=server, thread=thread)


def served_names(policy: Policy, model: str, adapters: str | None) -> tuple[str, tuple[str, ...]]:
    """(base model name, agent names) that `mappa serve` answers to.

    A plain model is served under the name it was given. A checkpoint's base is served under its
    base model name ("base" when the checkpoint stores the base itself or an agent has that name).
    """
    if not adapters:
        return model, ()
    agents = tuple(policy.agents)
    base_name = policy.base_name or "base"
    return ("base" if base_name in agents else base_name), agents


__all__ = ["Limits", "RunningServer", "bind", "context_length", "create_app", "served_names", "start_server"]
