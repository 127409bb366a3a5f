"""Rollouts per second of the demo's generation, one setting at a time, side by side in one run.

    python benchmarks/throughput_sweep.py                      # every setting, ~15 min on 2 cores
    python benchmarks/throughput_sweep.py --settings demo inference

Each setting starts a fresh process (its own vLLM engine) on the demo's config (recipes/configs/quickstart.yaml)
with the setting's overrides, draws the first step's population and problems, and times `generate_population`
(one untimed warm-up, then --reps timed calls on the same members). "inference" times the base model on the same
rows (each problem repeated once per member) on an engine without LoRA: the speed without the population. Writes
results/throughput_sweep.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# name -> recipe flags over the demo's config
SETTINGS: dict[str, list[str]] = {
    "demo": [],
    "inference": ["--perturbation", "full"],  # an engine without LoRA slots, as plain inference runs
    "prompts only (1 new token)": ["--max_completion_length", "1"],  # the prefill's share of the demo's time
    "lora kernel: vllm's own": ["--vllm_lora_kernel", "vllm"],
    "256 rollouts (16 problems)": ["--per_device_train_batch_size", "16"],
    "512 rollouts (32 members x 16 problems, 2 GiB KV)": [
        "--population_size", "32", "--per_device_train_batch_size", "16", "--vllm_cpu_kvcache_space", "2",
    ],
    "max_num_seqs 64": ["--vllm_engine_kwargs", '{"max_num_seqs": 64}'],
    "max_num_batched_tokens 2048": ["--vllm_engine_kwargs", '{"max_num_batched_tokens": 2048}'],
    "max_num_batched_tokens 16384": ["--vllm_engine_kwargs", '{"max_num_batched_tokens": 16384}'],
    "chunked prefill off": ["--vllm_engine_kwargs", '{"enable_chunked_prefill": false}'],
    "prefix caching on": ["--vllm_enable_prefix_caching", "true"],
    "KV cache 4 GiB": ["--vllm_cpu_kvcache_space", "4"],
    "1 thread": ["--vllm_cpu_threads", "1"],
    "adapters on attention only (q, k, v, o)": ["--lowrank_target_modules", "q_proj", "k_proj", "v_proj", "o_proj"],
    "adapters on MLPs only (gate, up, down)": ["--lowrank_target_modules", "gate_proj", "up_proj", "down_proj"],
    "detokenized by vLLM (a stop string)": ["--generation_kwargs", '{"stop": ["\\n\\n\\n\\n"]}'],
}  # fmt: skip


def measure(flags: list[str], reps: int, inference: bool) -> dict:
    """In this process: build the demo's trainer with `flags` and time its first step's generation."""
    from trl import ModelConfig, TrlParser

    from trl_dart_es import DartESConfig, DartESTrainer
    from trl_dart_es.tasks.arguments import TaskArguments

    argv = ["--config", str(ROOT / "recipes/configs/quickstart.yaml"), "--report_to", "none"]
    parser = TrlParser((TaskArguments, DartESConfig, ModelConfig))
    task, args, model = parser.parse_args_and_config(argv + ["--output_dir", "/tmp/throughput_sweep", *flags])
    args.model_init_kwargs = {"dtype": model.dtype or "float32"}
    train = task.load_split(task.dataset_train_split)
    trainer = DartESTrainer(
        model=model.model_name_or_path,
        reward_funcs=task.load_reward_funcs(train.column_names, args.max_completion_length),
        args=args,
        train_dataset=train,
    )
    batch, members = trainer.strategy.ask()
    prompts = trainer._rows(batch.ids)["prompt"]
    if inference:
        rows = [p for _ in members for p in prompts]
        call = lambda: [trainer.rollout.generate(rows)]  # noqa: E731
    else:
        call = lambda: trainer.rollout.generate_population(prompts, members)  # noqa: E731
    call()  # warm-up: first-call allocations
    times, tokens = [], 0
    for _ in range(reps):
        start = time.perf_counter()
        gens = call()
        times.append(time.perf_counter() - start)
        tokens = sum(g.num_tokens for g in gens)
    seconds = statistics.median(times)
    rollouts = len(members) * len(prompts)
    return {
        "rollouts": rollouts,
        "tokens": tokens,
        "seconds": [round(t, 3) for t in times],
        "median_s": round(seconds, 3),
        "rollouts_per_s": round(rollouts / seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--output-dir", type=Path, default=ROOT / "results")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one setting in this process
    cli = parser.parse_args()
    if cli.one is not None:
        print(
            "RESULT " + json.dumps(measure(SETTINGS[cli.one], cli.reps, cli.one == "inference")), flush=True
        )
        return

    from trl_dart_es.benchmark.machine import machine_description, utc_now

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    started, rows = utc_now(), []
    for name in cli.settings:
        cmd = [sys.executable, __file__, "--one", name, "--reps", str(cli.reps)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        row = {"setting": name, "flags": SETTINGS[name]}
        if proc.returncode == 0 and lines:
            row.update(json.loads(lines[-1].removeprefix("RESULT ")))
        else:
            row["error"] = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        rows.append(row)
        print(
            name, {k: row.get(k) for k in ("median_s", "rollouts_per_s", "tokens_per_s", "error")}, flush=True
        )

    demo = next((r for r in rows if r["setting"] == "demo" and "rollouts_per_s" in r), None)
    result = {"command": "python " + " ".join(["benchmarks/throughput_sweep.py", *sys.argv[1:]]),
              "machine": machine_description(), "started": started, "finished": utc_now(), "rows": rows}  # fmt: skip
    cli.output_dir.mkdir(parents=True, exist_ok=True)
    (cli.output_dir / "throughput_sweep.json").write_text(json.dumps(result, indent=1) + "\n")
    md = [
        "# Generation throughput of the demo's step, one setting at a time",
        "",
        f"- Command: `{result['command']}`",
        f"- Machine: {result['machine']}; {started} to {result['finished']}, one process at a time",
        "- Each row: a fresh engine, the demo's first population and problems, one warm-up `generate_population`,"
        f" then the median of {cli.reps} timed calls. `inference`: the same rows with no adapter.",
        "",
        "| setting | rollouts | median s | rollouts/s | tokens/s | vs demo |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['setting']} | – | – | – | – | failed: {r['error'][:80]} |")
            continue
        ratio = f"{r['rollouts_per_s'] / demo['rollouts_per_s']:.2f}x" if demo else "–"
        md.append(
            f"| {r['setting']} | {r['rollouts']} | {r['median_s']:.2f} | {r['rollouts_per_s']:.2f} | "
            f"{r['tokens_per_s']:.0f} | {ratio} |"
        )
    (cli.output_dir / "throughput_sweep.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
