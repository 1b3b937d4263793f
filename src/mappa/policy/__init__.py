"""The policy: base models and the trainable weights of each agent on them, generation, logprobs.

    models.py          base models: the embedded GGUF, packaged Qwen, HF dirs, tiny test models
    policy.py          `Policy`: one base, one adapter (or copy) per agent; batched generation, logprobs, save/load
    team.py            `Policies`: one Policy per base model, every agent on its own base's
    weights.py         the weight modes: one LoRA adapter per agent (or one shared), or a full copy per agent
    lora.py            the adapters' settings and peft-safe names; storage.py: the checkpoint files
    decoding.py        prefill, sampling, the decode loop; kvcache.py: KV layers with reserved room
    decoder.py, chat_engine.py, prefix_cache.py   continuous batching (what episodes and `mappa serve` sample from)
    sampling_copies.py what generate samples from on a CPU: each agent's adapter folded into a (bfloat16) copy
    precision.py       CPU bfloat16 autocast; sharding.py: FSDP2 over several ranks (no-ops in a local run)

Nothing is imported here, so that a light module of the package (precision, lora) does not load the rest.
"""
