"""The method registry: every row of the side-by-side benchmark and every curve of `--curves` is a `BenchMethod`."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class BenchMethod:
    """One row of the benchmark: a trainer kind, its recipe config, and the fields that make it this method.

    Args:
        name: the row's `method` key.
        kind: which runner trains it, a key of `RUNNERS` ("es": `DartESTrainer`, "grpo": TRL's `GRPOTrainer`).
        description: one line for the table.
        configs: recipe configs (file names in the config dir), the first that exists is used; none found means
            the trainer's defaults plus the workload.
        overrides: config fields set on top of the file (the workload is applied after these).
        default: part of the default `--methods` list (optional methods are run only when named).
        requires: modules that must be importable, checked before a subprocess is spent on the method.
        launch: Accelerate configs (file names in recipes/accelerate_configs/) for a multi-process row, as
            (on CPU, on CUDA); the child then runs under `accelerate launch` with `processes` processes.
        processes: how many processes a `launch` row runs (the same total workload, split over them).
    """

    name: str
    kind: str
    description: str
    configs: tuple[str, ...] = ()
    overrides: dict[str, Any] = field(default_factory=dict)
    default: bool = True
    requires: tuple[str, ...] = ()
    launch: tuple[str, str] | None = None
    processes: int = 1


_ES_CONFIGS = ("quickstart.yaml", "es_quickstart.yaml")
_GRPO_CONFIGS = ("grpo_quickstart.yaml",)
_PLAIN = "plain ES (no reweighting, no replay)"
_DART_ON = {"use_difficulty_reweighting": True, "use_targeted_replay": True}
_DART_OFF = {"use_difficulty_reweighting": False, "use_targeted_replay": False}
# Each ES row pins its backend and (but for the -demo rows) its generation precision (the model's own; the -bf16
# rows bf16), so that it measures what its name says whatever the demo config uses; the rest (antithetic pairs,
# rank, sigma, learning rate, ...) is the demo's (quickstart.yaml).
_FP32 = {"generation_dtype": None}
_BF16 = {"generation_dtype": "bfloat16"}
_FULL = {"perturbation": "full", "use_vllm": False, **_FP32}
_LOWRANK = {"perturbation": "lowrank", "use_vllm": False, **_FP32}
_VLLM_FULL = {"perturbation": "full", "use_vllm": True, "vllm_cpu_kvcache_space": 1, **_FP32}
# The demo's backend with the demo's own generation precision (the one set of rows that does not pin it).
_VLLM_DEMO = {"perturbation": "lowrank", "use_vllm": True, "vllm_cpu_kvcache_space": 1}
_VLLM_LOWRANK = {**_VLLM_DEMO, **_FP32}


def _es(name: str, description: str, *overrides: dict, kind: str = "es", **kw: Any) -> BenchMethod:
    """A row on the demo's configs, with the `overrides` merged in order."""
    merged = {k: v for o in overrides for k, v in o.items()}
    return BenchMethod(name, kind, description, _ES_CONFIGS, merged, **kw)


def _vllm(name: str, description: str, *overrides: dict, **kw: Any) -> BenchMethod:
    """A row on vLLM: run (and default) only where vLLM is installed."""
    return _es(name, description, *overrides, requires=("vllm",), **kw)


# One row per method (hand-wrapped: a table reads better than one argument per line).
METHODS: dict[str, BenchMethod] = {m.name: m for m in [
    _es("dart-es", "DART-ES, full-rank noise, transformers generate", _DART_ON, _FULL),
    # Plain ES is DART-ES's config with the two switches off: the only difference is the method itself.
    _es("es", f"{_PLAIN}, full-rank noise, transformers generate", _DART_OFF, _FULL),
    BenchMethod("grpo", "grpo", "TRL GRPOTrainer, full parameters", _GRPO_CONFIGS),
    BenchMethod("grpo-lora", "grpo", "TRL GRPOTrainer + LoRA (r=16, all linear)", ("grpo_lora_quickstart.yaml",)),
    _vllm("dart-es-vllm", "DART-ES, generation with vLLM (one weight push per member)", _DART_ON, _VLLM_FULL),
    # Every member a LoRA adapter of one vLLM engine: the whole population in one generate call.
    _vllm("dart-es-vllm-lowrank",
          "DART-ES, low-rank noise, vLLM: one LoRA adapter per member, one generate per population",
          _DART_ON, _VLLM_LOWRANK),
    # Plain ES on the same backend, fp32 generation.
    _vllm("es-vllm-lowrank", f"{_PLAIN}, low-rank noise, vLLM LoRA adapters", _DART_OFF, _VLLM_LOWRANK,
          default=False),
    # The demo as quickstart.yaml runs it (its generation precision included: `generation_dtype: auto`), and its
    # plain-ES twin: the learning curves' DART-ES and ES.
    _vllm("dart-es-demo",
          "DART-ES as the demo runs it: low rank on vLLM, the demo's generation precision (bf16 where native)",
          _DART_ON, _VLLM_DEMO, default=False),
    _vllm("es-demo", f"{_PLAIN} as the demo runs DART-ES", _DART_OFF, _VLLM_DEMO, default=False),
    # vLLM's ceiling: the same N x B rows generated by the unperturbed model in one engine call.
    _vllm("inference-vllm", "no training: the step's rollouts, unperturbed model, one vLLM generate", _DART_ON,
          _VLLM_FULL, kind="inference"),
    # The same two rows with the engine in bf16 (generation_dtype; the evolved weights stay fp32): optional,
    # since bf16 is only fast where the CPU computes it (avx512_bf16 or AMX) or on a GPU.
    _vllm("dart-es-vllm-lowrank-bf16", "dart-es-vllm-lowrank with the vLLM engine in bf16 (fp32 master weights)",
          _DART_ON, _VLLM_LOWRANK, _BF16, default=False),
    _vllm("inference-vllm-bf16", "inference-vllm with the engine in bf16", _DART_ON, _VLLM_FULL, _BF16,
          kind="inference", default=False),
    _es("dart-es-lowrank", "DART-ES, low-rank noise, one batched generation per population", _DART_ON, _LOWRANK),
    # The ceiling for rollout throughput: the same N x B rows generated by the unperturbed model in one batch.
    _es("inference", "no training: the step's rollouts, unperturbed model, one batched generate", _DART_ON,
        _LOWRANK, kind="inference"),
    # The noise cache (N x parameters x 4 bytes) trades memory for not drawing the noise twice per step.
    _es("dart-es-noise-cache", "DART-ES with the noise cache on (more memory, no second noise draw)", _DART_ON,
        _FULL, {"noise_cache": "on"}, default=False),
    # Two processes, the same total workload: DART-ES splits the population (a full replica per process), GRPO
    # runs as it usually runs sharded, under DeepSpeed ZeRO-2 / ZeRO-3 (docs/scaling.md).
    _es("dart-es-2proc", "DART-ES, 2 processes (population split, full replica each)", _DART_ON, _FULL,
        default=False, launch=("cpu_2proc.yaml", "multi_gpu.yaml"), processes=2),
    *(BenchMethod(f"grpo-zero{k}", "grpo", f"TRL GRPOTrainer, 2 processes, DeepSpeed ZeRO-{k}", _GRPO_CONFIGS,
                  default=False, requires=("deepspeed",), processes=2,
                  launch=(f"deepspeed_zero{k}_cpu.yaml", f"deepspeed_zero{k}.yaml")) for k in (2, 3)),
]}  # fmt: skip


def _missing(modules: Sequence[str]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def _installed(modules: Sequence[str]) -> bool:
    return not _missing(modules)


# Rows that need an optional package (vLLM) are default only where it is installed.
DEFAULT_METHODS: tuple[str, ...] = tuple(
    name for name, m in METHODS.items() if m.default and _installed(m.requires)
)


# `--curves` compares these by default: DART-ES as the demo runs it (quickstart.yaml: low rank on vLLM, bf16
# generation where native), its plain-ES twin, and the two GRPO baselines.
CURVE_METHODS: tuple[str, ...] = ("dart-es-demo", "es-demo", "grpo", "grpo-lora")
