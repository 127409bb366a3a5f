"""Is bf16 generation faster than fp32 with plain `transformers` on this machine? The embedded model, the demo's
prompt and length, one batched greedy `generate` of the demo's 128 rows (4 members x 32 prompts, unperturbed),
fp32 and bf16 alternating. Answers whether `generation_dtype` should reach the transformers backends too.

    python benchmarks/transformers_bf16_speed.py      # ~4 min on 2 cores

Writes results/transformers_bf16_speed.{json,md}.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_dart_es.benchmark.machine import machine_description, utc_now
from trl_dart_es.embedded import resolve_model_path
from trl_dart_es.rollout.prompts import render_prompts
from trl_dart_es.tasks import load_task_dataset

ROWS, PROMPTS, TOKENS, REPEATS = 128, 32, 64, 2
OUT = Path(__file__).resolve().parent.parent / "results" / "transformers_bf16_speed"


def main() -> None:
    path = resolve_model_path("embedded:smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    prompts = load_task_dataset("embedded:gsm8k", "test", prompt_style="answer", num_examples=PROMPTS)[
        "prompt"
    ]
    texts = render_prompts(prompts, tokenizer) * (ROWS // PROMPTS)
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    models = {
        dtype: AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        for dtype in ("float32", "bfloat16")
    }
    seconds: dict[str, list[float]] = {d: [] for d in models}
    tokens: dict[str, int] = {}
    with torch.no_grad():
        for model in models.values():  # warm-up, not timed
            model.generate(**enc, max_new_tokens=4, do_sample=False)
        for _ in range(REPEATS):
            for dtype, model in models.items():
                t0 = time.perf_counter()
                out = model.generate(
                    **enc, max_new_tokens=TOKENS, do_sample=False, pad_token_id=tokenizer.eos_token_id
                )
                seconds[dtype].append(time.perf_counter() - t0)
                new = out[:, enc["input_ids"].shape[1] :]
                tokens[dtype] = int((new != tokenizer.eos_token_id).sum())
    rows = {
        d: {"seconds": s, "median_s": statistics.median(s), "tokens": tokens[d],
            "tokens_per_s": tokens[d] / statistics.median(s)}
        for d, s in seconds.items()
    }  # fmt: skip
    ratio = rows["bfloat16"]["median_s"] / rows["float32"]["median_s"]
    result = {"machine": machine_description(), "date": utc_now(), "rows": rows, "bf16_over_fp32_time": ratio}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# bf16 against fp32 generation with plain transformers",
        "",
        f"`python benchmarks/transformers_bf16_speed.py` on {result['machine']}, {result['date']}. Embedded "
        f"SmolLM2-135M, {ROWS} rows ({PROMPTS} held-out prompts x {ROWS // PROMPTS}) in one greedy `generate`, "
        f"{TOKENS} new tokens, fp32 and bf16 alternating, {REPEATS} runs each.",
        "",
        "| dtype | seconds (runs) | tokens/s (median) |",
        "| --- | --- | ---: |",
        *[
            f"| {d} | {', '.join(f'{s:.1f}' for s in r['seconds'])} | {r['tokens_per_s']:.0f} |"
            for d, r in rows.items()
        ],
        "",
        f"bf16/fp32 time: **{ratio:.2f}**.",
    ]
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
