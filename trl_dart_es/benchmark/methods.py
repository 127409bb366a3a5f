"""The method registry: every row of the side-by-side benchmark and every curve of `--curves` is a `BenchMethod`."""

from __future__ import annotations

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
        default: part of the default `--methods` list. Optional methods (backends still in progress) are run only
            when named.
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
_DART_ON = {"use_difficulty_reweighting": True, "use_targeted_replay": True}
_DART_OFF = {"use_difficulty_reweighting": False, "use_targeted_replay": False}
# Each ES row pins its backend and (but for the -demo rows) its generation precision (the model's own; the -bf16
# rows bf16), so that it measures what its name says whatever the demo config uses; the rest (antithetic pairs,
# rank, sigma, learning rate, ...) is the demo's (quickstart.yaml).
_FP32 = {"generation_dtype": None}
_FULL = {"perturbation": "full", "use_vllm": False, **_FP32}
_LOWRANK = {"perturbation": "lowrank", "use_vllm": False, **_FP32}
_VLLM_FULL = {"perturbation": "full", "use_vllm": True, "vllm_cpu_kvcache_space": 1, **_FP32}
# The demo's backend with the demo's own generation precision (the one set of rows that does not pin it).
_VLLM_DEMO = {"perturbation": "lowrank", "use_vllm": True, "vllm_cpu_kvcache_space": 1}
_VLLM_LOWRANK = {**_VLLM_DEMO, **_FP32}

METHODS: dict[str, BenchMethod] = {
    m.name: m
    for m in [
        BenchMethod(
            "dart-es",
            "es",
            "DART-ES, full-rank noise, transformers generate",
            _ES_CONFIGS,
            {**_DART_ON, **_FULL},
        ),
        # Plain ES is DART-ES's config with the two switches off: the only difference is the method itself.
        BenchMethod(
            "es",
            "es",
            "plain ES (no reweighting, no replay), full-rank noise, transformers generate",
            _ES_CONFIGS,
            {**_DART_OFF, **_FULL},
        ),
        BenchMethod("grpo", "grpo", "TRL GRPOTrainer, full parameters", ("grpo_quickstart.yaml",)),
        BenchMethod(
            "grpo-lora", "grpo", "TRL GRPOTrainer + LoRA (r=16, all linear)", ("grpo_lora_quickstart.yaml",)
        ),
        BenchMethod(
            "dart-es-vllm",
            "es",
            "DART-ES, generation with vLLM (one weight push per member)",
            _ES_CONFIGS,
            {**_DART_ON, **_VLLM_FULL},
            requires=("vllm",),
        ),
        # Every member a LoRA adapter of one vLLM engine: the whole population in one generate call.
        BenchMethod(
            "dart-es-vllm-lowrank",
            "es",
            "DART-ES, low-rank noise, vLLM: one LoRA adapter per member, one generate per population",
            _ES_CONFIGS,
            {**_DART_ON, **_VLLM_LOWRANK},
            requires=("vllm",),
        ),
        # Plain ES on the same backend, fp32 generation.
        BenchMethod(
            "es-vllm-lowrank",
            "es",
            "plain ES (no reweighting, no replay), low-rank noise, vLLM LoRA adapters",
            _ES_CONFIGS,
            {**_DART_OFF, **_VLLM_LOWRANK},
            default=False,
            requires=("vllm",),
        ),
        # The demo as quickstart.yaml runs it (its generation precision included: `generation_dtype: auto`), and
        # its plain-ES twin: the learning curves' DART-ES and ES.
        BenchMethod(
            "dart-es-demo",
            "es",
            "DART-ES as the demo runs it: low rank on vLLM, the demo's generation precision (bf16 where native)",
            _ES_CONFIGS,
            {**_DART_ON, **_VLLM_DEMO},
            default=False,
            requires=("vllm",),
        ),
        BenchMethod(
            "es-demo",
            "es",
            "plain ES (no reweighting, no replay) as the demo runs DART-ES",
            _ES_CONFIGS,
            {**_DART_OFF, **_VLLM_DEMO},
            default=False,
            requires=("vllm",),
        ),
        # vLLM's ceiling: the same N x B rows generated by the unperturbed model in one engine call.
        BenchMethod(
            "inference-vllm",
            "inference",
            "no training: the step's rollouts, unperturbed model, one vLLM generate",
            _ES_CONFIGS,
            {**_DART_ON, **_VLLM_FULL},
            requires=("vllm",),
        ),
        # The same two rows with the engine in bf16 (generation_dtype; the evolved weights stay fp32): optional,
        # since bf16 is only fast where the CPU computes it (avx512_bf16 or AMX) or on a GPU.
        BenchMethod(
            "dart-es-vllm-lowrank-bf16",
            "es",
            "dart-es-vllm-lowrank with the vLLM engine in bf16 (fp32 master weights)",
            _ES_CONFIGS,
            {**_DART_ON, **_VLLM_LOWRANK, "generation_dtype": "bfloat16"},
            default=False,
            requires=("vllm",),
        ),
        BenchMethod(
            "inference-vllm-bf16",
            "inference",
            "inference-vllm with the engine in bf16",
            _ES_CONFIGS,
            {**_DART_ON, **_VLLM_FULL, "generation_dtype": "bfloat16"},
            default=False,
            requires=("vllm",),
        ),
        BenchMethod(
            "dart-es-lowrank",
            "es",
            "DART-ES, low-rank noise, one batched generation per population",
            _ES_CONFIGS,
            {**_DART_ON, **_LOWRANK},
        ),
        # The ceiling for rollout throughput: the same N x B rows generated by the unperturbed model in one batch.
        BenchMethod(
            "inference",
            "inference",
            "no training: the step's rollouts, unperturbed model, one batched generate",
            _ES_CONFIGS,
            {**_DART_ON, **_LOWRANK},
        ),
        # The noise cache (N x parameters x 4 bytes) trades memory for not drawing the noise twice per step.
        BenchMethod(
            "dart-es-noise-cache",
            "es",
            "DART-ES with the noise cache on (more memory, no second noise draw)",
            _ES_CONFIGS,
            {**_DART_ON, **_FULL, "noise_cache": "on"},
            default=False,
        ),
        # Two processes, the same total workload: DART-ES splits the population (a full replica per process),
        # GRPO runs as it usually runs sharded, under DeepSpeed ZeRO-2 / ZeRO-3 (docs/scaling.md).
        BenchMethod(
            "dart-es-2proc",
            "es",
            "DART-ES, 2 processes (population split, full replica each)",
            _ES_CONFIGS,
            {**_DART_ON, **_FULL},
            default=False,
            launch=("cpu_2proc.yaml", "multi_gpu.yaml"),
            processes=2,
        ),
        BenchMethod(
            "grpo-zero2",
            "grpo",
            "TRL GRPOTrainer, 2 processes, DeepSpeed ZeRO-2",
            ("grpo_quickstart.yaml",),
            default=False,
            requires=("deepspeed",),
            launch=("deepspeed_zero2_cpu.yaml", "deepspeed_zero2.yaml"),
            processes=2,
        ),
        BenchMethod(
            "grpo-zero3",
            "grpo",
            "TRL GRPOTrainer, 2 processes, DeepSpeed ZeRO-3",
            ("grpo_quickstart.yaml",),
            default=False,
            requires=("deepspeed",),
            launch=("deepspeed_zero3_cpu.yaml", "deepspeed_zero3.yaml"),
            processes=2,
        ),
    ]
}


def _installed(modules: Sequence[str]) -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in modules)


# Rows that need an optional package (vLLM) are default only where it is installed.
DEFAULT_METHODS: tuple[str, ...] = tuple(
    name for name, m in METHODS.items() if m.default and _installed(m.requires)
)


# `--curves` compares these by default: DART-ES as the demo runs it (quickstart.yaml: low rank on vLLM, bf16
# generation where native), its plain-ES twin, and the two GRPO baselines.
CURVE_METHODS: tuple[str, ...] = ("dart-es-demo", "es-demo", "grpo", "grpo-lora")


def _missing_requirements(method: BenchMethod) -> list[str]:
    import importlib.util

    return [m for m in method.requires if importlib.util.find_spec(m) is None]
