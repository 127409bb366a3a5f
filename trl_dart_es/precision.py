"""Generation precision: the dtype a vLLM engine generates in, apart from the dtype of the weights ES evolves.

The trainer's model keeps its own dtype (fp32 for the embedded model): perturbations are drawn, and updates
accumulated, there. A bf16 engine receives those weights rounded at every push, so rounding never accumulates
across steps; in the low-rank vLLM mode the perturbation is a LoRA adapter computed beside the rounded base
weight, so bf16's resolution does not swallow sigma either.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

__all__ = ["GENERATION_DTYPES", "cpu_bf16_flags", "cpu_supports_bf16", "resolve_generation_dtype"]

GENERATION_DTYPES = ("auto", "float32", "bfloat16", "float16")
# CPU flags of native bf16 arithmetic (AVX512-BF16 dot products, AMX tiles): without them bf16 is emulated and
# slower than fp32 (platform-facts.md: ~4x slower on an AVX2 machine).
_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_bf16_flags(cpuinfo: str | None = None) -> list[str]:
    """This CPU's native bf16 flags (of ``avx512_bf16``, ``amx_bf16``) in /proc/cpuinfo; [] where there are none."""
    if cpuinfo is None:
        cpuinfo = ""
        with contextlib.suppress(OSError):
            cpuinfo = Path("/proc/cpuinfo").read_text()
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    return [flag for flag in _BF16_CPU_FLAGS if flag in flags]


def cpu_supports_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has native bf16 units (``avx512_bf16`` or ``amx_bf16`` in /proc/cpuinfo's flags)."""
    return bool(cpu_bf16_flags(cpuinfo))


def resolve_generation_dtype(
    requested: str | None, model_dtype: torch.dtype, *, on_cuda: bool, cpuinfo: str | None = None
) -> torch.dtype:
    """The engine's dtype for ``requested`` (``DartESConfig.generation_dtype``).

    None: the model's own dtype (the reference). ``"auto"``: bfloat16 for an fp32 model where the hardware
    computes bf16 natively (a CUDA device that supports it, or a CPU with ``avx512_bf16``/AMX), else the model's
    dtype. A dtype name: that dtype.
    """
    if requested is None:
        return model_dtype
    if requested not in GENERATION_DTYPES:
        raise ValueError(f"generation_dtype={requested!r}: choose one of {GENERATION_DTYPES} or None")
    if requested != "auto":
        return getattr(torch, requested)
    if model_dtype != torch.float32:
        return model_dtype
    native = torch.cuda.is_bf16_supported() if on_cuda else cpu_supports_bf16(cpuinfo)
    return torch.bfloat16 if native else model_dtype
