"""Serving: continuous batching over a `mappa.policy.policy.Policy`, behind `mappa serve`.

- `decoder`: `Decoder`, a batch that rows join and leave between decode steps (`decoding(policy, agent)`);
- `kv`: the KV-cache layer with reserved room that the decoder writes into (subclasses transformers' cache);
- `prefix_cache`: prompt KV reused across requests that share an opening;
- `engine`: `ChatEngine`, one worker thread batching concurrent chat requests;
- `server`: the OpenAI-compatible FastAPI app and an in-process uvicorn runner.

Training never imports this package: the policy's own `generate` is a plain batched loop.
"""
