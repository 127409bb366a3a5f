"""bf16 against fp32 generation on the demo's path (vLLM, low rank): untrained held-out accuracy, paired by
prompt, and generation speed. Answers whether `generation_dtype="bfloat16"` can be trusted and what it buys.

    python benchmarks/bf16_parity.py     # 512 held-out prompts, the quickstart's prompt and length; ~6 min

Writes results/bf16_parity.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from trl_dart_es import DartESConfig, DartESTrainer
from trl_dart_es.benchmark.machine import machine_description, utc_now
from trl_dart_es.rewards import gsm8k_accuracy_reward, gsm8k_format_reward
from trl_dart_es.rollout.prompts import as_completions
from trl_dart_es.rollout.vllm import shutdown_engine
from trl_dart_es.tasks import load_task_dataset


def evaluate(generation_dtype: str | None, test, batch: int) -> dict:
    """Per-prompt correctness and tokens/s of the untrained model on the demo's settings."""
    args = DartESConfig(
        output_dir="/tmp/bf16_parity", population_size=4, antithetic=True, per_device_train_batch_size=32,
        max_completion_length=64, perturbation="lowrank", use_vllm=True, vllm_cpu_kvcache_space=1,
        generation_dtype=generation_dtype, use_cpu=True, report_to="none",
    )  # fmt: skip
    trainer = DartESTrainer(
        model="embedded:smollm2-135m",
        reward_funcs=[gsm8k_accuracy_reward, gsm8k_format_reward],
        args=args,
        train_dataset=load_task_dataset("embedded:gsm8k", "train", prompt_style="answer"),
    )
    correct, tokens, seconds = [], 0, 0.0
    trainer.rollout.generate(test["prompt"][:batch])  # warm-up (and the weight push), not timed
    for start in range(0, len(test), batch):
        rows = test[start : start + batch]
        t0 = time.perf_counter()
        gen = trainer.rollout.generate(rows["prompt"])
        seconds += time.perf_counter() - t0
        tokens += gen.num_tokens
        rewards = gsm8k_accuracy_reward(as_completions(rows["prompt"], gen.texts), rows["answer"])
        correct += [float(r or 0.0) for r in rewards]
    dtype = str(trainer.rollout.engine.dtype).removeprefix("torch.")
    shutdown_engine()
    return {"dtype": dtype, "correct": correct, "tokens_per_s": tokens / seconds, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--output_dir", default="results")
    args = parser.parse_args()
    test = load_task_dataset("embedded:gsm8k", "test", prompt_style="answer", num_examples=args.prompts)
    fp32, bf16 = evaluate(None, test, args.batch), evaluate("bfloat16", test, args.batch)
    a, b = np.array(fp32["correct"]), np.array(bf16["correct"])
    diff = b - a
    half = 1.96 * diff.std(ddof=1) / math.sqrt(len(diff))
    report = {
        "command": f"python benchmarks/bf16_parity.py --prompts {args.prompts}",
        "machine": machine_description(),
        "date": utc_now(),
        "torch_threads": torch.get_num_threads(),
        "prompts": len(diff),
        "accuracy": {"float32": a.mean(), "bfloat16": b.mean()},
        "difference_points": 100 * diff.mean(),
        "difference_95ci_points": [100 * (diff.mean() - half), 100 * (diff.mean() + half)],
        "prompts_that_differ": int((diff != 0).sum()),
        "tokens_per_s": {"float32": fp32["tokens_per_s"], "bfloat16": bf16["tokens_per_s"]},
        "speedup": bf16["tokens_per_s"] / fp32["tokens_per_s"],
    }
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bf16_parity.json").write_text(json.dumps(report, indent=2) + "\n")
    lo, hi = report["difference_95ci_points"]
    lines = [
        "# bf16 against fp32 generation (vLLM, the demo's low-rank path), untrained",
        "",
        f"`{report['command']}` on {report['machine']}, {report['date']}. Embedded SmolLM2-135M (fp32 weights),",
        f"{report['prompts']} held-out prompts of `embedded:gsm8k` (prompt style `answer`), greedy, 64 tokens.",
        "",
        "| generation dtype | held-out accuracy | tokens/s |",
        "| --- | ---: | ---: |",
        f"| float32 | {100 * a.mean():.1f}% | {fp32['tokens_per_s']:.0f} |",
        f"| bfloat16 | {100 * b.mean():.1f}% | {bf16['tokens_per_s']:.0f} |",
        "",
        f"bf16 − fp32: {report['difference_points']:+.1f} points, 95% interval [{lo:+.1f}, {hi:+.1f}] (paired by "
        f"prompt; {report['prompts_that_differ']} prompts scored differently). Generation speed-up: "
        f"{report['speedup']:.2f}x.",
    ]
    (out / "bf16_parity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
