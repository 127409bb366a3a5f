"""Step time of DartESTrainer with 1 process vs 2 processes on the same machine (population split).

    flock /tmp/heavy.lock .venv/bin/python benchmarks/scaling.py      # writes results/scaling.{json,md}

Runs the quickstart (recipes/configs/quickstart_fullrank.yaml: embedded SmolLM2-135M, embedded GSM8K, N = 8, B = 16,
64 new tokens) for `--steps` ES steps, twice:

* 1 process with `--threads` threads (default: all cores);
* `accelerate launch --multi_gpu --num_processes 2` with threads / 2 threads per process, so both runs use the
  same cores. `--use_cpu true` puts the two processes in one gloo group on a machine without GPUs.

Each process records the wall time of every step, the trainer's timing metrics and its peak RSS. The first
step includes one-time costs (allocating the noise cache, warming up kernels), so the table reports it apart
from the mean of the later steps. Also records the bytes one process sends per step for the reward gather.
Takes ~5-10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import pickle
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMING_KEYS = ("time/generation", "time/reward", "time/es", "tokens_per_s", "reward")


# ------------------------------------------------------------------------------------------------ worker
def worker(config: str, steps: int, out: Path) -> None:
    """One process of a run: build the trainer as recipes/dart_es_gsm8k.py does, train, write a record."""
    import numpy as np
    import torch
    from trl import ModelConfig, TrlParser

    from trl_dart_es import DartESConfig, DartESTrainer
    from trl_dart_es.benchmark.clock import StepClock
    from trl_dart_es.tasks.arguments import TaskArguments

    parser = TrlParser((TaskArguments, DartESConfig, ModelConfig))
    script_args, args, model_args = parser.parse_args_and_config(
        [
            "--config",
            config,
            "--max_steps",
            str(steps),
            "--output_dir",
            str(out / "trainer"),
            "--use_cpu",
            "true",
        ]
    )
    args.model_init_kwargs = {"dtype": model_args.dtype or "float32", **(args.model_init_kwargs or {})}
    train = script_args.load_split(script_args.dataset_train_split)
    trainer = DartESTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=script_args.load_reward_funcs(),
        args=args,
        train_dataset=train,
    )
    acc = trainer.accelerator
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    assert acc.num_processes == world == int(os.environ.get("WORLD_SIZE", 1)), (acc.num_processes, world)

    clock = StepClock()
    trainer.add_callback(clock.callback())
    trainer.train()

    # What this process sends per step in the reward gather (see DartESTrainer._gather_rewards).
    batch, members = trainer.strategy.ask()
    local = trainer._local_members(len(members))
    k, b = len(trainer.scorer), len(batch.ids)
    fingerprint = (tuple(batch.ids), tuple((m.seed, m.sign) for m in members))
    rows = [(n, np.zeros((k, b)), 0) for n in local]
    digest = hashlib.sha256()
    for p in trainer.model.parameters():
        digest.update(p.detach().numpy().tobytes())
    record = {
        "rank": acc.process_index,
        "world_size": world,
        "torch_threads": torch.get_num_threads(),
        "local_members": local,
        "step_s": clock.step_times,
        "logs": [{key: e[key] for key in TIMING_KEYS if key in e} for e in trainer.state.log_history],
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "gather_payload_bytes": len(pickle.dumps((fingerprint, rows))),
        "reward_payload_bytes": k * len(local) * b * 8,
        "num_parameters": trainer.es_params.num_parameters,
        "weights_sha256": digest.hexdigest(),
        "population_size": args.population_size,
        "batch_size": args.per_device_train_batch_size,
        "max_completion_length": args.max_completion_length,
        "num_rewards": k,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{acc.process_index}.json").write_text(json.dumps(record))


# ------------------------------------------------------------------------------------------------ driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(processes: int, threads: int, config: str, steps: int, out: Path) -> tuple[float, list[float]]:
    me = [
        str(Path(__file__).resolve()),
        "--worker",
        "--config",
        config,
        "--steps",
        str(steps),
        "--out",
        str(out),
    ]
    if processes == 1:
        cmd = [sys.executable, *me]
    else:
        cmd = [
            sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
            "--num_processes", str(processes), "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--main_process_port", str(_free_port()), *me,
        ]  # fmt: skip
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    load = [os.getloadavg()[0]]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    load.append(os.getloadavg()[0])
    if proc.returncode != 0:
        sys.exit(f"run with {processes} process(es) failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return wall, load


def _summary(records: list[dict], wall: float, load: list[float], processes: int, threads: int) -> dict:
    steps = [max(r["step_s"][i] for r in records) for i in range(len(records[0]["step_s"]))]
    later = steps[1:] or steps
    r0 = records[0]
    logs = r0["logs"][: len(steps)]

    def mean_of(key):
        values = [log[key] for log in logs[1:] or logs if key in log]
        return statistics.fmean(values) if values else None

    return {
        "processes": processes,
        "threads_per_process": threads,
        "world_size_seen": r0["world_size"],
        "members_per_process": [r["local_members"] for r in records],
        "step_s": steps,
        "first_step_s": steps[0],
        "later_steps_mean_s": statistics.fmean(later),
        "generation_s": mean_of("time/generation"),
        "es_s": mean_of("time/es"),
        "tokens_per_s_all_processes": mean_of("tokens_per_s"),
        "peak_rss_gb_per_process": [round(r["peak_rss_gb"], 2) for r in records],
        "gather_payload_bytes_per_process": [r["gather_payload_bytes"] for r in records],
        "reward_payload_bytes_per_process": [r["reward_payload_bytes"] for r in records],
        "rewards_per_step": [log.get("reward") for log in logs],
        "weights_sha256": [r["weights_sha256"] for r in records],
        "launch_wall_s": wall,
        "load_average_start_end": load,
    }


def _machine() -> str:
    import torch

    from trl_dart_es.benchmark import cpu_model

    cpu = cpu_model()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{cpu}, {os.cpu_count()} cores, {platform.platform()}; torch {torch.__version__}; load average {load:.2f}"


def _pair(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def _markdown(result: dict) -> str:
    one, two = result["runs"]
    lines = [
        "# 1 process vs 2 processes (population split)",
        "",
        f"- command: `{result['command']}`",
        f"- date: {result['date']}",
        f"- machine: {result['machine']} (shared with other jobs: see the load average)",
        f"- config: `{result['config']}` with max_steps={result['steps']}: N = {result['population_size']}, "
        f"B = {result['batch_size']}, max_completion_length = {result['max_completion_length']}, "
        f"{result['num_parameters']:,} parameters",
        "",
        "| | 1 process | 2 processes |",
        "| --- | ---: | ---: |",
        f"| threads per process | {one['threads_per_process']} | {two['threads_per_process']} |",
        f"| members per process | {len(one['members_per_process'][0])} | "
        f"{' + '.join(str(len(m)) for m in two['members_per_process'])} |",
        f"| first step (s) | {one['first_step_s']:.1f} | {two['first_step_s']:.1f} |",
        f"| later steps, mean (s) | {one['later_steps_mean_s']:.1f} | {two['later_steps_mean_s']:.1f} |",
        f"| of which generation (s, rank 0) | {one['generation_s']:.1f} | {two['generation_s']:.1f} |",
        f"| of which ES bookkeeping (s, rank 0) | {one['es_s']:.1f} | {two['es_s']:.1f} |",
        f"| generated tokens/s, all processes | {one['tokens_per_s_all_processes']:.0f} | "
        f"{two['tokens_per_s_all_processes']:.0f} |",
        f"| peak RSS per process (GB) | {', '.join(map(str, one['peak_rss_gb_per_process']))} | "
        f"{', '.join(map(str, two['peak_rss_gb_per_process']))} |",
        f"| bytes sent per process per step | 0 | {', '.join(map(str, two['gather_payload_bytes_per_process']))} |",
        f"| load average (start, end of run) | {_pair(one['load_average_start_end'])} | "
        f"{_pair(two['load_average_start_end'])} |",
        "",
        f"Speed-up of the later steps: **{result['speedup_later_steps']:.2f}x**. "
        f"Same rewards at every step: {result['same_rewards']}; same final weights: {result['same_weights']}.",
        "",
        "The bytes per step are the pickled reward gather of one process (its members' K x B rewards as float64, "
        "token counts, and a fingerprint of the step's batch ids and seeds); no weights cross processes. "
        "Each process redraws the noise of the other processes' members for the update, which is the ES "
        "bookkeeping that does not shrink with more processes.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="recipes/configs/quickstart_fullrank.yaml")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="cores to use in all")
    p.add_argument("--output", default="results/scaling", help="writes OUTPUT.json and OUTPUT.md")
    p.add_argument("--markdown-only", action="store_true", help="rewrite OUTPUT.md from OUTPUT.json, no runs")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    cli = p.parse_args()
    if cli.worker:
        worker(cli.config, cli.steps, Path(cli.out))
        return
    if cli.markdown_only:
        out = REPO / cli.output
        out.with_suffix(".md").write_text(_markdown(json.loads(out.with_suffix(".json").read_text())))
        return

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for processes in (1, 2):
            threads = max(1, cli.threads // processes)
            out = Path(tmp) / f"p{processes}"
            print(f"running {processes} process(es) x {threads} thread(s) ...", flush=True)
            wall, load = _launch(processes, threads, cli.config, cli.steps, out)
            records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(processes)]
            assert all(r["world_size"] == processes for r in records), "wrong number of processes started"
            runs.append((records, _summary(records, wall, load, processes, threads)))
    (one_rec, one), (two_rec, two) = runs
    base = one_rec[0]
    result = {
        "command": " ".join(["python", "benchmarks/scaling.py", *sys.argv[1:]]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(),
        "config": cli.config,
        "steps": cli.steps,
        "population_size": base["population_size"],
        "batch_size": base["batch_size"],
        "max_completion_length": base["max_completion_length"],
        "num_rewards": base["num_rewards"],
        "num_parameters": base["num_parameters"],
        "runs": [one, two],
        "speedup_later_steps": one["later_steps_mean_s"] / two["later_steps_mean_s"],
        "same_rewards": one["rewards_per_step"] == two["rewards_per_step"],
        "same_weights": len(set(one["weights_sha256"] + two["weights_sha256"])) == 1,
    }
    out = REPO / cli.output
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(_markdown(result))
    print(_markdown(result))


if __name__ == "__main__":
    main()
