"""vLLM on CPU: what serving the population as LoRA adapters costs inside `generate`, alone in a process.

One engine per mode, each in a fresh process, on the quickstart rollouts (embedded SmolLM2-135M, fp32, N = 8 members
x B = 8 GSM8K prompts, exactly 40 new tokens per row via `min_tokens`, greedy, the process's default threads):

- `plain`: no LoRA; the 64 rows (each prompt 8 times) in one `generate` (the `inference-vllm` row's work);
- `lora`: `enable_lora=True`, 8 rank-1 adapters (one per member), the population in one `generate`
  (`VLLMLowRankRollout.generate_population`, the `dart-es-vllm-lowrank` row's work);
- `lora-base`: the LoRA engine, the same 64 rows without adapters;
- `lora-updated`: as `lora`, but the base weights change before every generate (a tiny ES update), so each
  generate first pushes them into the engine, as in training; the push is timed apart and left out.

`--natural-lengths` lets rows stop at EOS instead (the training step's case; the modes then generate slightly
different token counts, so compare tokens/s). Each mode times `--repeats` generates after one warm-up, then
profiles one more with `torch.profiler` (self CPU time per op). Run under the heavy-job lock on an otherwise idle machine:

    flock /tmp/heavy.lock .venv/bin/python benchmarks/vllm_lora_profile.py   # ~5 min on 2 cores
    # writes results/vllm_lora_profile.{json,md}
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "plain": "no LoRA, 64 rows",
    "lora": "LoRA engine, 8 adapters (one per member), 64 rows",
    "lora-base": "LoRA engine, 64 rows without adapters",
    "lora-updated": "as lora, base weights updated and pushed before each generate (push time left out)",
}
# Ops the grouped LoRA matmuls and their bookkeeping run (trl_dart_es/rollout/grouped_lora.py), by names the
# model's own layers do not use here: the one-hot pick (`bmm`) counts, its broadcast `mul`/`sum` cannot.
LORA_OPS = (
    "aten::addmm_", "aten::mm", "aten::bmm", "aten::index", "aten::_index_put_impl_", "aten::zeros", "aten::cat",
)  # fmt: skip


def measure(mode: str, repeats: int, natural_lengths: bool = False) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from trl_dart_es.embedded import load_model, load_tokenizer
    from trl_dart_es.lowrank import LowRankParameters, lora_carried_names
    from trl_dart_es.noise import population
    from trl_dart_es.perturb import EvolvedParameters
    from trl_dart_es.rollout.transformers import greedy_generation_config
    from trl_dart_es.rollout.vllm import VLLMRollout, shutdown_engine, start_engine
    from trl_dart_es.rollout.vllm_lowrank import VLLMLowRankRollout
    from trl_dart_es.tasks import load_task_dataset

    n, b, t = 8, 8, 40
    model = load_model("embedded:smollm2-135m", dtype=torch.float32).eval()
    tokenizer = load_tokenizer("embedded:smollm2-135m")
    prompts = load_task_dataset("embedded:gsm8k", "train")["prompt"][:b]
    rows = [p for p in prompts for _ in range(n)]
    members = population(1234, n)
    gc = greedy_generation_config(tokenizer, t)
    # Every row decodes all t tokens unless asked otherwise: then the modes do the same work.
    fixed = None if natural_lengths else {"min_tokens": t}
    tokens = [n * b * t]
    if mode == "plain":
        engine = start_engine(model, cpu_kvcache_space=1, max_model_len=1024)
        rollout = VLLMRollout(
            model, tokenizer, gc, EvolvedParameters(model, 2e-3), engine, generation_kwargs=fixed
        )
    else:
        engine = start_engine(model, cpu_kvcache_space=1, max_model_len=1024, max_loras=n, max_lora_rank=1)
        params = LowRankParameters(model, 2e-3, rank=1, names=lora_carried_names(model))
        rollout = VLLMLowRankRollout(model, tokenizer, gc, params, engine, generation_kwargs=fixed)

    z = [float(i) - (n - 1) / 2 for i in range(n)]

    def prepare() -> None:
        if mode == "lora-updated":
            params.update(members, z, 1e-6)  # a new base: the next generate pushes it first

    def run() -> float:
        """One generate; returns the seconds spent pushing weights and handing over adapters."""
        if mode.startswith("lora") and mode != "lora-base":
            tokens[0] = sum(g.num_tokens for g in rollout.generate_population(prompts, members))
            return rollout.last_perturb_time
        tokens[0] = rollout.generate(rows).num_tokens
        return 0.0

    run()  # warm-up
    times, pushes = [], []
    for _ in range(repeats):
        prepare()
        t0 = time.perf_counter()
        push = run()
        times.append(time.perf_counter() - t0 - push)
        pushes.append(push)
    prepare()
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # lora-updated: the push is in the profile
        run()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops) / 1e6
    shutdown_engine()
    return {
        "mode": mode,
        "what": MODES[mode],
        "generate_s": times,
        "push_and_handover_s": pushes,
        "tokens": tokens[0],
        "tokens_per_s_best": tokens[0] / min(times),
        "profiled_self_cpu_s": total,
        "lora_ops_self_cpu_s": sum(e.self_cpu_time_total for e in ops if e.key in LORA_OPS) / 1e6,
        "top_ops": [
            {"op": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6, "calls": e.count} for e in ops[:12]
        ],
        "threads": torch.get_num_threads(),
    }


def render(results: list[dict], command: str, natural_lengths: bool) -> str:
    lines = [
        "# vLLM on CPU: the LoRA population's cost inside `generate`",
        "",
        f"- Command: `{command}`; {results[0]['date']}; {results[0]['machine']}.",
        "- Each mode in a fresh process: embedded SmolLM2-135M fp32, 64 rows of "
        + ("up to 40 new tokens (stopping at EOS)" if natural_lengths else "exactly 40 new tokens")
        + ", greedy, "
        f"{results[0]['threads']} threads; best of the timed generates (push and adapter hand-over left out), then "
        "one profiled generate (with them).",
        "",
        "| mode | what | generate (s) | push + hand-over (s) | tokens | tokens/s (best) | profiled self CPU (s) "
        "| of it grouped-LoRA ops (s) |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        times = " ".join(f"{x:.2f}" for x in r["generate_s"])
        pushes = " ".join(f"{x:.2f}" for x in r["push_and_handover_s"])
        lines.append(
            f"| `{r['mode']}` | {r['what']} | {times} | {pushes} | {r['tokens']} | {r['tokens_per_s_best']:.1f} | "
            f"{r['profiled_self_cpu_s']:.2f} | {r['lora_ops_self_cpu_s']:.2f} |"
        )
    lines += ["", "Top ops by self CPU time (profiled generate):", ""]
    for r in results:
        top = ", ".join(f"{o['op']} {o['self_cpu_s']:.2f} s" for o in r["top_ops"][:6])
        lines.append(f"- `{r['mode']}`: {top}")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--natural-lengths", action="store_true", help="rows stop at EOS (default: exactly 40 tokens)"
    )
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--output", default=str(ROOT / "results" / "vllm_lora_profile"))
    p.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:  # one mode in this fresh process; the result as JSON on the last line of stdout
        print(json.dumps(measure(args.child, args.repeats, args.natural_lengths)), flush=True)
        return
    from trl_dart_es.benchmark import machine_description

    results = []
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    lengths = ["--natural-lengths"] if args.natural_lengths else []
    for mode in modes:
        out = subprocess.run(
            [sys.executable, __file__, "--child", mode, "--repeats", str(args.repeats), *lengths],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        result = json.loads(out.strip().splitlines()[-1])
        result["date"] = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        result["machine"] = machine_description()
        print(f"{mode:10s} best {result['tokens_per_s_best']:6.1f} tok/s  {result['generate_s']}", flush=True)
        results.append(result)
    command = " ".join(["python benchmarks/vllm_lora_profile.py", *sys.argv[1:]])
    Path(args.output + ".json").write_text(
        json.dumps(
            {"command": command, "natural_lengths": args.natural_lengths, "results": results}, indent=1
        )
        + "\n"
    )
    Path(args.output + ".md").write_text(render(results, command, args.natural_lengths))
    print(f"wrote {args.output}.json, {args.output}.md")


if __name__ == "__main__":
    main()
