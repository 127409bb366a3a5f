"""The child process's side (`python -m trl_dart_es.benchmark --child <spec>`, started by `process.spawn`): run
one method, one curve or the untrained baseline, and write the result file. Under `accelerate launch` (a
multi-process row) every process runs it; only rank 0 reports progress and writes the result, which carries
every process's peak memory (`ranks`).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
from pathlib import Path

from .curves import curve_child
from .evaluation import evaluate_trainer
from .methods import METHODS
from .run import RUNNERS, _baseline
from .trainers import _use_cuda, _world_size
from .workload import Workload


def _peak_memory_mb() -> dict[str, float]:
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    scale = 1 / 2**20 if sys.platform == "darwin" else 1 / 1024
    out = {
        "peak_rss_self_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale,
        "peak_rss_children_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale,
    }
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["peak_cuda_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
            out["peak_cuda_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
    return out


def child_main(spec_path: str) -> int:
    """Run the child of `spec_path` (a method, a curve or the baseline evaluation); write its result."""
    spec = json.loads(Path(spec_path).read_text())
    workload = Workload(**spec["workload"])
    progress_path = Path(spec["progress_path"])
    rank = int(os.environ.get("RANK", "0"))

    def progress(text: str) -> None:
        if rank == 0:
            with contextlib.suppress(OSError):
                progress_path.write_text(text)

    started = time.perf_counter()
    if spec.get("mode") == "curve":
        result = curve_child(spec, workload, progress)
    elif spec["method"] == "_baseline":
        result = _baseline(workload, progress)
    else:
        method = METHODS[spec["method"]]
        result = RUNNERS[method.kind](method, workload, progress)
        trainer = result.pop("trainer")
        if trainer is not None:
            progress("evaluating")
            result["eval"] = evaluate_trainer(trainer, workload)
    result.pop("reward_weights", None)
    result.update(_peak_memory_mb())
    if _world_size() > 1:  # every process's peak memory
        import torch.distributed as dist

        result["ranks"] = [None] * dist.get_world_size()
        dist.all_gather_object(result["ranks"], _peak_memory_mb())
        result["processes"] = len(result["ranks"])
        if rank != 0:
            return 0
    with contextlib.suppress(Exception):
        import torch

        result["device"] = (
            f"cuda ({torch.cuda.get_device_name(0)})"
            if _use_cuda(workload)
            else f"cpu ({torch.get_num_threads()} threads)"
        )
    result["wall_s"] = time.perf_counter() - started
    Path(spec["result_path"]).write_text(json.dumps(result, default=str))
    return 0
