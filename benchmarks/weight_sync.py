"""What it costs to tell whether a vLLM engine holds the model's current weights: version counters against the
per-tensor float64 checksum they replaced (which missed changes that keep a tensor's sum).

    python benchmarks/weight_sync.py            # embedded SmolLM2-135M, fp32 and bf16; writes results/weight_sync.*

Both are timed on the same model in one process, alternating, after an update-like in-place write to every
linear weight (so the version counters have moved and the sums must be recomputed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from trl_dart_es.benchmark.machine import machine_description, utc_now
from trl_dart_es.embedded import resolve_model_path
from trl_dart_es.rollout.vllm import WeightSignal, engine_weights


def checksum(model: torch.nn.Module) -> torch.Tensor:
    """The check used before: per-tensor float64 sums of every weight pushed to the engine."""
    return torch.stack([t.sum(dtype=torch.float64) for _, t in engine_weights(model)])


def signal_check(model: torch.nn.Module, held: WeightSignal) -> set[str] | None:
    return WeightSignal.of(model).changed_since(held)


def measure(dtype: torch.dtype, repeats: int) -> dict:
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("embedded:smollm2-135m"), dtype=dtype)
    linear = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]
    held = WeightSignal.of(model)
    times: dict[str, list[float]] = {"checksum": [], "version counters": []}
    for _ in range(repeats):
        with torch.no_grad():
            for p in linear:  # an in-place write to every matrix, as an update makes
                p.mul_(1.0)
        for name, fn in (
            ("checksum", lambda: checksum(model)),
            ("version counters", lambda: signal_check(model, held)),
        ):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    changed = signal_check(model, held)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "tensors": len(list(model.parameters())),
        "changed_seen": len(changed or ()),
        "median_s": {k: statistics.median(v) for k, v in times.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output_dir", default="results")
    args = parser.parse_args()
    rows = [measure(dtype, args.repeats) for dtype in (torch.float32, torch.bfloat16)]
    report = {
        "command": "python benchmarks/weight_sync.py",
        "machine": machine_description(),
        "date": utc_now(),
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
    }
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight_sync.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Weight sync check: version counters against the float64 checksum",
        "",
        f"`{report['command']}` on {report['machine']}, {report['date']}, {report['torch_threads']} torch threads. "
        "Median of the repeats; embedded SmolLM2-135M.",
        "",
        "| dtype | tensors | checksum (ms) | version counters (ms) | ratio |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        c, v = row["median_s"]["checksum"], row["median_s"]["version counters"]
        lines.append(f"| {row['dtype']} | {row['tensors']} | {c * 1e3:.1f} | {v * 1e3:.2f} | {v / c:.3f} |")
    (out / "weight_sync.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
