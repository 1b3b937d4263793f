"""Where the agents' tokens come from: one `Generator` (`mappa.protocols`) per backend, behind which the runtime
(`mappa.workflows.runtime`) sends every episode's requests.

`generation.backend: local` (default): `LocalGenerator`, the policy that trains, continuously batched
(`mappa.policy.chat_engine.ChatEngine` on its sampling copies): requests of concurrent episodes decode together, a
request joining the running batch at the next token. A team on several base models (`mappa.policy.team`) has a
`TeamGenerator`: one `LocalGenerator` per base, each agent's requests sent to its base's.
`generation.backend: server`: `ServerGenerator` sends every request to `generation.base_url` (vLLM, SGLang or
`mappa serve`), and `sync` publishes each agent's adapter after every step and has the server load it
(`ServerPolicy.load_adapters`). A server's log-probs are never the update's (`samples_exactly` is false: the trainer
recomputes them at the sampling temperature, and measures how far the server's are, `mappa.training.rl.logprob_gap`),
which is small only when the server reports temperature-scaled log-probs too (vLLM: `--logprobs-mode
processed_logprobs`; docs/training.md). Setup and the GPU recipes: docs/scale.md.

The local generators live in `local.py`, the server's in `server.py` (publishing in `adapters.py`), and `build.py`
builds the configured one.
"""

from mappa.generation.adapters import adapter_name, adapter_states, publish_adapters, version_dir
from mappa.generation.build import adapter_root, build_generator, check_backend, step_sync
from mappa.generation.local import LocalGenerator, PolicyGenerator, TeamGenerator, local_generator
from mappa.generation.server import ServedGeneration, ServerGenerator, ServerPolicy

__all__ = [
    "LocalGenerator",
    "PolicyGenerator",
    "ServedGeneration",
    "ServerGenerator",
    "ServerPolicy",
    "TeamGenerator",
    "adapter_name",
    "adapter_root",
    "adapter_states",
    "build_generator",
    "check_backend",
    "local_generator",
    "publish_adapters",
    "step_sync",
    "version_dir",
]
