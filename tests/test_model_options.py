"""The options a GPU user sets on the base model and its chat template, with a tiny model saved as a real HF
directory: `model.init_kwargs` reach `from_pretrained` (model and tokenizer), `generation.chat_template_kwargs`
template the trainer's, the local policy's and the server's prompts alike, and saved adapters name their base as
the user gave it."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from helpers import save_tiny

from mappa.config import ModelConfig, load_config
from mappa.errors import MappaError
from mappa.generation import ServerPolicy, build_generator, publish_adapters
from mappa.policy.chat_engine import load_policy
from mappa.policy.models import EMBEDDED_HUB_ID, EMBEDDED_NAME, load_base_model, public_name, tiny_model_and_tokenizer
from mappa.policy.policy import Policy
from mappa.serving.server import create_app, start_server
from mappa.types import Message

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# ChatML whose generation prompt branches on a template variable, as Qwen3's does: an empty think block when
# enable_thinking is false.
CHAT = [Message(role="user", content="What is 2 + 3?")]
NO_THINKING = {"enable_thinking": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-dir"))


# ---------------------------------------------------------------------------------------------------- init_kwargs
def test_init_kwargs_reach_from_pretrained_and_survive_a_checkpoint(model_dir: Path, tmp_path: Path) -> None:
    for impl in ("eager", "sdpa"):
        cfg = ModelConfig(name=str(model_dir), init_kwargs={"attn_implementation": impl}, lora_r=4)
        policy = Policy.from_config(cfg, ["solver"], seed=0)
        assert policy.model.get_base_model().config._attn_implementation == impl
    policy.save(tmp_path / "ckpt")  # the last one: sdpa
    manifest = json.loads((tmp_path / "ckpt" / "mappa_policy.json").read_text())
    assert manifest["init_kwargs"] == {"attn_implementation": "sdpa"}
    reloaded = Policy.from_checkpoint(tmp_path / "ckpt", device="cpu")
    assert reloaded.model.get_base_model().config._attn_implementation == "sdpa"
    assert reloaded.base_init_kwargs == {"attn_implementation": "sdpa"}


def test_revision_picks_a_cached_hub_snapshot_and_is_ignored_for_a_directory(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--mappa-test--tiny"
    commits = {"a" * 40: 0, "b" * 40: 1}  # two snapshots of one hub id, with different weights
    for commit, seed in commits.items():
        save_tiny(repo / "snapshots" / commit, seed=seed)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    def embedding(name: str, **init_kwargs: object) -> torch.Tensor:
        return load_base_model(name, init_kwargs=init_kwargs)[0].get_input_embeddings().weight

    main, at_b = embedding("mappa-test/tiny"), embedding("mappa-test/tiny", revision="b" * 40)
    assert torch.equal(main, tiny_model_and_tokenizer(seed=0)[0].get_input_embeddings().weight)
    assert torch.equal(at_b, tiny_model_and_tokenizer(seed=1)[0].get_input_embeddings().weight)
    with pytest.raises(MappaError, match="at revision 'c{40}'"):
        embedding("mappa-test/tiny", revision="c" * 40)
    assert torch.equal(embedding(str(model_dir), revision="v9"), main)  # a directory has no revisions


def test_trust_remote_code_reaches_the_model_and_the_tokenizer(tmp_path: Path) -> None:
    directory = save_tiny(tmp_path / "custom")
    (directory / "configuration_tinycustom.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass TinyCustomConfig(LlamaConfig):\n    model_type = 'tiny_custom'\n"
    )
    (directory / "modeling_tinycustom.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_tinycustom import TinyCustomConfig\n\n\n"
        "class TinyCustomForCausalLM(LlamaForCausalLM):\n    config_class = TinyCustomConfig\n"
    )
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type="tiny_custom", architectures=["TinyCustomForCausalLM"], auto_map={
        "AutoConfig": "configuration_tinycustom.TinyCustomConfig",
        "AutoModelForCausalLM": "modeling_tinycustom.TinyCustomForCausalLM",
    })  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    model, tokenizer = load_base_model(str(directory), init_kwargs={"trust_remote_code": True})
    assert type(model).__name__ == "TinyCustomForCausalLM"  # the directory's own code ran
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_dtype_in_init_kwargs_is_model_dtype(model_dir: Path) -> None:
    model, _ = load_base_model(str(model_dir), init_kwargs={"torch_dtype": "bfloat16"})
    assert model.dtype == torch.bfloat16
    model, _ = load_base_model(str(model_dir), dtype="bfloat16", init_kwargs={"dtype": "bfloat16"})
    assert model.dtype == torch.bfloat16
    with pytest.raises(MappaError, match=r"^model.init_kwargs.dtype: 'float16' contradicts model.dtype 'float32'"):
        load_base_model(str(model_dir), dtype="float32", init_kwargs={"dtype": "float16"})


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="bitsandbytes would load it")
def test_a_quantization_config_dict_reaches_the_quantizer(model_dir: Path) -> None:
    # No CUDA and no bitsandbytes here: the dict became a BitsAndBytesConfig, whose quantizer refuses to start.
    with pytest.raises(MappaError) as e:
        load_base_model(str(model_dir), init_kwargs={"quantization_config": {"load_in_4bit": True}})
    assert "bitsandbytes" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(MappaError, match=r"^model.init_kwargs.quantization_config: .*quant_method"):
        load_base_model(str(model_dir), init_kwargs={"quantization_config": {"bits": 4}})


def test_bad_init_kwargs_are_one_line_errors(model_dir: Path) -> None:
    with pytest.raises(MappaError, match=r"model.init_kwargs \['attn_implmentation'\].*unexpected keyword") as e:
        load_base_model(str(model_dir), init_kwargs={"attn_implmentation": "eager"})
    assert "\n" not in str(e.value)
    with pytest.raises(MappaError, match="^model.init_kwargs: 'tiny-random' is built in memory"):
        load_base_model("tiny-random", init_kwargs={"attn_implementation": "eager"})


# ------------------------------------------------------------------------------------------- chat_template_kwargs
@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[str]:
    """`mappa serve --model DIR` in-process: its own copy of the model, as the server loads it."""
    running = start_server(create_app(load_policy(str(model_dir)), str(model_dir), max_batch=4))
    yield running.url
    running.stop()


def test_chat_template_kwargs_config_key_is_checked() -> None:
    cfg = load_config(None, ["generation.chat_template_kwargs.enable_thinking=false"])
    assert cfg.generation.chat_template_kwargs == NO_THINKING
    with pytest.raises(MappaError, match="generation.chat_template_kwargs: add_generation_prompt: set by mappa"):
        load_config(None, ["generation.chat_template_kwargs.add_generation_prompt=false"])


def test_trainer_and_server_template_the_same_prompt(model_dir: Path, served: str) -> None:
    """The tokens trained on are the tokens generated: with enable_thinking=false the trainer's prompt ids (local
    policy) equal the ones the server templated from the request, and differ from the default template's."""
    overrides = [f"model.name={model_dir}", "model.lora_r=4", "generation.chat_template_kwargs.enable_thinking=false"]
    local_cfg = load_config(None, overrides)
    policy = Policy.from_config(local_cfg.model, ["solver"], seed=0)
    default_ids = policy.chat_ids(CHAT)
    assert build_generator(local_cfg, policy).policy is policy
    trained_ids = policy.chat_ids(CHAT)
    assert trained_ids != default_ids and policy.tokenizer.decode(trained_ids).endswith("<think>\n\n</think>\n\n")
    local = policy.generate("solver", [CHAT], temperature=0, max_new_tokens=4)[0]
    assert list(local.prompt_ids) == trained_ids

    server_cfg = load_config(None, [*overrides, "generation.backend=server", f"generation.base_url={served}"])
    client = build_generator(server_cfg, policy).server
    assert isinstance(client, ServerPolicy)
    try:
        gen = client.generate("solver", [CHAT], temperature=0, max_new_tokens=4)[0]
    finally:
        client.close()
    # the server echoes the prompt it templated (return_token_ids); a different one would be dropped
    assert gen.dropped is None and list(gen.prompt_ids) == trained_ids
    assert list(gen.response_ids) == list(local.response_ids)  # greedy, same weights: the same tokens


def test_a_served_request_applies_its_chat_template_kwargs(model_dir: Path, served: str) -> None:
    policy = Policy.from_config(ModelConfig(name=str(model_dir), lora_r=4), ["solver"], seed=0)
    body = {"model": str(model_dir), "messages": [{"role": "user", "content": CHAT[0].content}], "max_tokens": 2}
    body |= {"temperature": 0, "return_token_ids": True}
    with httpx.Client(timeout=60) as http:
        plain = http.post(f"{served}/chat/completions", json=body).json()
        off = http.post(f"{served}/chat/completions", json={**body, "chat_template_kwargs": NO_THINKING}).json()
        reserved = http.post(f"{served}/chat/completions", json={**body, "chat_template_kwargs": {"tokenize": True}})
    assert plain["prompt_token_ids"] == policy.chat_ids(CHAT)
    assert off["prompt_token_ids"] == policy.chat_ids(CHAT, NO_THINKING) != plain["prompt_token_ids"]
    assert reserved.status_code == 400 and reserved.json()["error"]["param"] == "chat_template_kwargs"


# ------------------------------------------------------------------------------------------------- adapter base
def test_saved_adapters_name_the_base_as_the_user_gave_it(model_dir: Path, tmp_path: Path) -> None:
    cfg = ModelConfig(name=str(model_dir), lora_r=4, init_kwargs={"revision": "main"})
    Policy.from_config(cfg, ["solver", "verifier"], seed=0).save(tmp_path / "dir")
    for adapter in ("agent_solver", "agent_verifier"):
        config = json.loads((tmp_path / "dir" / "adapters" / adapter / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(model_dir) and config["revision"] == "main"

    # the embedded model is read from a dequantized cache; its adapters name the hub id it was quantized from
    model, tokenizer = tiny_model_and_tokenizer()
    embedded = Policy.from_model(model, tokenizer, ["solver"], base_name=EMBEDDED_NAME, lora_r=4)
    embedded.save(tmp_path / "embedded")
    published = publish_adapters(embedded, tmp_path / "published", 1)
    for path in (tmp_path / "embedded" / "adapters" / "agent_solver", published["solver"]):
        config = json.loads((path / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == EMBEDDED_HUB_ID == public_name(EMBEDDED_NAME)
    assert public_name("Qwen/Qwen3-4B") == "Qwen/Qwen3-4B"
