"""Who may call `mappa serve` and how much they may send: the API key, the request size cap, the adapter roots.

- `APIKeyMiddleware`: every path but `/health` needs `Authorization: Bearer KEY` (401 otherwise), as vLLM's
  `--api-key` does; the key is compared in constant time.
- `BodyLimitMiddleware`: a body over the cap is a 413, whether it announces its length or streams it in chunks;
  nothing past the cap is read into memory.
- `AdapterRoots`: `POST /v1/load_lora_adapter` reads adapters only from directories under these roots. The
  directory is opened once beneath its root without following any link (`mappa.beneath`), and its
  files are read through that descriptor: a link below the root is refused, wherever it leads, and a path
  swapped for a link after the check is never read.

Both middlewares are plain ASGI: they answer before FastAPI parses anything.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
from collections.abc import Sequence
from pathlib import Path, PurePath
from typing import Any

from mappa.beneath import FileRefused, open_beneath
from mappa.errors import MappaError

OPEN_PATHS = frozenset({"/health"})  # liveness probes carry no credentials

Scope = dict[str, Any]


async def send_error(
    send: Any, status: int, message: str, type_: str, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """An OpenAI-style JSON error, sent straight over ASGI."""
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": None}}).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class APIKeyMiddleware:
    """401 for any request but `/health` without `Authorization: Bearer <key>`."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self._expected = b"Bearer " + api_key.encode()

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if not secrets.compare_digest(given, self._expected):
            message = "missing or wrong API key (send Authorization: Bearer <key>)"
            return await send_error(send, 401, message, "authentication_error", [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


class _TooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """413 for a request body over `max_bytes`: at once when Content-Length says so, else as soon as the
    streamed chunks pass it (the app's own answer is then replaced)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await self._reject(send)
        seen, over, started = 0, False, False

        async def counted() -> Any:
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    over = True
                    raise _TooLarge
            return message

        async def guarded(message: Any) -> None:
            nonlocal started
            if over:  # whatever the app makes of the failed read, the answer is the 413 below
                return
            started = True
            await send(message)

        try:
            await self.app(scope, counted, guarded)
        except Exception:
            if not over:
                raise
        if over and not started:
            await self._reject(send)

    async def _reject(self, send: Any) -> None:
        mib = self.max_bytes / 2**20
        await send_error(
            send, 413, f"request body over {mib:g} MiB (mappa serve --max-body-mib)", "invalid_request_error"
        )


def is_loopback_host(host: str) -> bool:
    """Whether listening on `host` accepts connections from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class AdapterDir:
    """An adapter directory opened beneath an adapter root (`AdapterRoots.open`): its files are read through
    `fd` (`mappa.beneath.read_beneath`), never by `path`, which is how the client named it. Close it
    when done (it is a context manager)."""

    def __init__(self, path: str, fd: int) -> None:
        self.path, self.fd = path, fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> AdapterDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AdapterRoots:
    """The directories adapters may be loaded from (see the module docstring). A root itself is the operator's
    and may be a link; it is opened at every load, so a root created after start (a run's first publish)
    counts from then on."""

    def __init__(self, roots: Sequence[str | os.PathLike]) -> None:
        self.roots = tuple(os.path.abspath(os.fspath(r)) for r in roots)

    def __repr__(self) -> str:
        return ", ".join(self.roots) or "none"

    def open(self, path: str) -> AdapterDir:
        """The directory `path` opened beneath the root it lies in, no link followed below the root; else a
        MappaError saying why. `path` is matched against each root as configured and as resolved."""
        if not self.roots:
            raise MappaError(
                "loading adapters is off: this server has no adapter root (mappa serve --adapter-root DIR)"
            )
        if ".." in PurePath(path).parts:
            raise MappaError(f"lora_path {path}: '..' is not allowed")
        where = self._beneath(os.path.abspath(path))
        if where is None:
            raise MappaError(f"lora_path {path} is outside the adapter roots ({self!r})")
        root, rel = where
        try:
            root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise MappaError(f"No adapter found for {path} (the adapter root {root}: {e.strerror})") from None
        try:
            return AdapterDir(path, open_beneath(root_fd, rel, os.O_RDONLY | os.O_DIRECTORY))
        except FileRefused as e:
            if e.kind == "missing":
                raise MappaError(f"No adapter found for {path} ({e})") from None
            raise MappaError(f"lora_path {path}: {e}") from None
        finally:
            os.close(root_fd)

    def _beneath(self, path: str) -> tuple[str, str] | None:
        """(the root `path` lies in, spelled as `path` spells it; `path` relative to that root), or None."""
        for root in self.roots:
            for spelled in dict.fromkeys((root, os.path.realpath(root))):
                if _within(path, spelled):
                    return spelled, os.path.relpath(path, spelled)
        return None


def default_adapter_roots(adapters: str | None, cwd: Path | None = None) -> list[Path]:
    """Where a trainer started next to this server publishes: `runs/` under the working directory (the default
    `run_dir`'s parent, `<run_dir>/adapters` below it), and the run directory of the checkpoint served with
    `--adapters` (the folder above its `checkpoints/`, else the checkpoint itself)."""
    roots = [(cwd or Path.cwd()) / "runs"]
    if adapters:
        ckpt = Path(adapters).absolute()
        run = next((p.parent for p in ckpt.parents if p.name == "checkpoints"), ckpt)
        roots.append(run)
    return roots
