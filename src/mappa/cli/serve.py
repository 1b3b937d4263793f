"""`mappa serve`: load a model (and a checkpoint's agents), print where it is served, serve until Ctrl-C."""

from __future__ import annotations

import os
from collections.abc import Sequence

from mappa.errors import MappaError

API_KEY_ENV = "MAPPA_API_KEY"


def serve_command(
    model: str,
    adapters: str | None,
    host: str,
    port: int,
    max_batch: int,
    prefix_cache_mib: float = 512,
    threads: int | None = None,
    *,
    api_key: str | None = None,
    adapter_roots: Sequence[str] = (),
    max_loaded_adapters: int = 16,
    max_model_len: int | None = None,
    max_body_mib: float = 8.0,
) -> int:
    """`mappa serve`: the OpenAI-compatible server of `mappa.serving.server` on `host:port`.

    Without an API key (`--api-key` or `$MAPPA_API_KEY`) anyone who can reach the port may generate and load
    adapters, so the server then listens on a loopback address only and refuses any other `--host`."""
    from mappa.serving.guard import AdapterRoots, default_adapter_roots, is_loopback_host

    api_key = api_key or os.environ.get(API_KEY_ENV) or None
    if api_key is None and not is_loopback_host(host):  # before the heavy imports: a mistake fails at once
        raise MappaError(
            f"--host {host}: without an API key mappa serve listens on loopback only "
            f"(set --api-key or ${API_KEY_ENV}, or use --host 127.0.0.1)"
        )
    _check_numbers(max_batch, prefix_cache_mib, threads, max_loaded_adapters, max_body_mib, max_model_len)

    import uvicorn
    from rich.console import Console

    from mappa.policy.chat_engine import load_policy
    from mappa.serving.server import Limits, bind, context_length, create_app, served_names

    roots = AdapterRoots(adapter_roots or default_adapter_roots(adapters))
    console = Console(stderr=True)
    sock = bind(host, port)  # fail fast on a taken port, before minutes of model loading
    with console.status(f"loading {adapters or model}..."):
        policy = load_policy(model, adapters)
    base_name, agents = served_names(policy, model, adapters)
    limits = Limits(api_key, roots.roots, max_loaded_adapters, max_model_len, max_body_mib)
    app = create_app(policy, base_name, agents, max_batch=max_batch, prefix_cache_mib=prefix_cache_mib, limits=limits)
    served = ", ".join([base_name, *agents])
    console.print(f"mappa serve: {served} at http://{host}:{sock.getsockname()[1]}/v1 (max batch {max_batch})")
    console.print(f"mappa serve: adapters load from under {roots!r}")
    nominal = context_length(policy)
    if max_model_len is not None and max_model_len > nominal:
        console.print(f"mappa serve: --max-model-len {max_model_len} is past the model's context ({nominal})")
    if api_key is None:
        console.print(f"mappa serve: no API key (--api-key or ${API_KEY_ENV}): listening on {host} only")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    server.run(sockets=[sock])
    return 0


def _check_numbers(
    max_batch: int,
    prefix_cache_mib: float,
    threads: int | None,
    max_loaded_adapters: int,
    max_body_mib: float,
    max_model_len: int | None,
) -> None:
    if max_batch < 1:
        raise MappaError(f"--max-batch must be >= 1 (got {max_batch})")
    if prefix_cache_mib < 0:
        raise MappaError(f"--prefix-cache-mib must be >= 0 (got {prefix_cache_mib})")
    if max_loaded_adapters < 1:
        raise MappaError(f"--max-loaded-adapters must be >= 1 (got {max_loaded_adapters})")
    if max_body_mib <= 0:
        raise MappaError(f"--max-body-mib must be > 0 (got {max_body_mib})")
    if max_model_len is not None and max_model_len < 2:
        raise MappaError(f"--max-model-len must be >= 2 (got {max_model_len})")
    if threads is not None:
        if threads < 1:
            raise MappaError(f"--threads must be >= 1 (got {threads})")
        import torch

        # Fewer threads than cores leaves room for clients on the same machine: small models gain
        # little from intra-op threads, and threads that wait on a busy core stall every op.
        torch.set_num_threads(threads)
