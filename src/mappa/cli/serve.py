"""`mappa serve`: load a model (and a checkpoint's agents), print where it is served, serve until Ctrl-C."""

from __future__ import annotations

from mappa.errors import MappaError


def serve_command(
    model: str,
    adapters: str | None,
    host: str,
    port: int,
    max_batch: int,
    prefix_cache_mib: float = 512,
    threads: int | None = None,
) -> int:
    """`mappa serve`: the OpenAI-compatible server of `mappa.serving.server` on `host:port`."""
    import uvicorn
    from rich.console import Console

    from mappa.serving.engine import load_policy
    from mappa.serving.server import bind, create_app, served_names

    if max_batch < 1:
        raise MappaError(f"--max-batch must be >= 1 (got {max_batch})")
    if prefix_cache_mib < 0:
        raise MappaError(f"--prefix-cache-mib must be >= 0 (got {prefix_cache_mib})")
    if threads is not None:
        if threads < 1:
            raise MappaError(f"--threads must be >= 1 (got {threads})")
        import torch

        # Fewer threads than cores leaves room for clients on the same machine: small models gain
        # little from intra-op threads, and threads that wait on a busy core stall every op.
        torch.set_num_threads(threads)
    console = Console(stderr=True)
    sock = bind(host, port)  # fail fast on a taken port, before minutes of model loading
    with console.status(f"loading {adapters or model}..."):
        policy = load_policy(model, adapters)
    base_name, agents = served_names(policy, model, adapters)
    app = create_app(policy, base_name, agents, max_batch=max_batch, prefix_cache_mib=prefix_cache_mib)
    served = ", ".join([base_name, *agents])
    console.print(f"mappa serve: {served} at http://{host}:{sock.getsockname()[1]}/v1 (max batch {max_batch})")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    server.run(sockets=[sock])
    return 0
