"""What vLLM's torch.compile buys on this CPU, and what share of a generation the prompts take.

    python benchmarks/vllm_compile.py          # ~5 min on 2 CPU cores

The vLLM engines of this package start with `enforce_eager=True` on the CPU. This script measures why: one
fresh process per mode (`eager`, `compiled`) starts a plain engine on the embedded model (fp32), then
generates greedily the demo's rollouts (128 train prompts of the "answer" style, up to 64 tokens) three
times, then once with `max_tokens=1` (the prompts' prefill and one token). Writes
results/vllm_compile.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from trl_dart_es.benchmark import machine_description

ROOT = Path(__file__).resolve().parent.parent
MODES = ("eager", "compiled")


def measure(mode: str, prompts: int, max_tokens: int, repeats: int) -> dict:
    """Runs in its own process: engine start, `repeats` timed generations, one prefill-only generation."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # as the demo (vllm_cpu_kvcache_space: 1)
    from vllm import LLM, SamplingParams

    from trl_dart_es.embedded import load_tokenizer, resolve_model_path
    from trl_dart_es.rollout.prompts import render_prompts
    from trl_dart_es.tasks.gsm8k import make_synthetic_gsm8k

    model_dir = resolve_model_path("embedded:smollm2-135m")
    tok = load_tokenizer(model_dir)
    data = make_synthetic_gsm8k(prompts, split="train", prompt_style="answer")
    encoded = tok(render_prompts(data["prompt"], tok), add_special_tokens=False)["input_ids"]
    rows = [{"prompt_token_ids": ids} for ids in encoded]
    start = time.perf_counter()
    llm = LLM(
        model=model_dir, dtype="float32", max_model_len=1024, enforce_eager=mode == "eager",
        enable_prefix_caching=False, disable_log_stats=True,
    )  # fmt: skip
    result = {"mode": mode, "start_s": time.perf_counter() - start, "generate_s": []}
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(rows, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        result["generate_s"].append(time.perf_counter() - start)
    result["completion_tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
    result["prompt_tokens"] = sum(len(r["prompt_token_ids"]) for r in rows)
    start = time.perf_counter()
    llm.generate(rows, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    result["prefill_s"] = time.perf_counter() - start
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument(
        "--prompts", type=int, default=128, help="rollouts per generation (the demo's 4 x 32)"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=str(ROOT / "results" / "vllm_compile"))
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one mode, in this process; prints JSON
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure(args.child, args.prompts, args.max_tokens, args.repeats)))
        return

    rows = []
    for mode in args.modes:  # a fresh process each: one engine per process, no warm state carried over
        cmd = [sys.executable, __file__, "--child", mode, "--prompts", str(args.prompts)]
        cmd += ["--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            raise RuntimeError(f"mode {mode} failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
        rows.append(json.loads(lines[-1].removeprefix("RESULT ")))
        print(json.dumps(rows[-1]))
    meta = {
        "machine": machine_description(),
        "command": "python " + shlex.join(["benchmarks/vllm_compile.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    out = Path(args.output)
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    lines = [
        "# vLLM on the CPU: eager against torch.compile, and the prompts' share of a generation",
        "",
        f"- {args.prompts} rollouts of the demo's prompts, greedy, up to {args.max_tokens} tokens, plain engine, "
        f"fp32; {meta['date']}; machine: {meta['machine']}.",
        f"- Command: `{meta['command']}`.",
        "",
        "| mode | engine start (s) | generate (s), each run | prefill + 1 token (s) | prompt tokens | completion tokens |",
        "| --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        runs = " ".join(f"{s:.1f}" for s in r["generate_s"])
        lines.append(
            f"| {r['mode']} | {r['start_s']:.1f} | {runs} | {r['prefill_s']:.1f} | {r['prompt_tokens']} | "
            f"{r['completion_tokens']} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
