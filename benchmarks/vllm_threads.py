"""vLLM on CPU: 1 against 2 torch threads, on both vLLM ES paths, interleaved so that machine noise cancels.

The vLLM engine runs inside the trainer's process on CPU, so both share torch's intra-op threads (vLLM's own
serving default is 1 thread). This probe measures which count the process should use. Workload: the quickstart one
(embedded SmolLM2-135M, fp32, N = 8 members x B = 8 GSM8K prompts, 40 new tokens, greedy). Every row decodes
exactly 40 tokens (`min_tokens`), so every run does the same work. Per path, one engine; the thread counts
alternate within it (1, 2 / 2, 1 / ...), `--repeats` rounds after one warm-up per count. Each run times
`generate_population` (what an ES step generates) and then the ES update (the rest of the step also runs on
the same threads). Last, the low-rank path's two ways of handing the members' factors to vLLM (in memory,
or PEFT folders on /dev/shm) are timed against each other. Run under the heavy-job lock, on an otherwise
idle machine:

    flock /tmp/heavy.lock .venv/bin/python benchmarks/vllm_threads.py   # ~7 min on 2 cores
    # writes docs/benchmarks/vllm_threads.{json,md}
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "OMP_NUM_THREADS" in os.environ:  # it would pin vLLM's (and torch's) thread count: nothing to compare
    raise SystemExit("unset OMP_NUM_THREADS: this probe sets the torch threads itself")

import torch  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

from trl_dart_es.embedded import load_model, load_tokenizer  # noqa: E402
from trl_dart_es.lowrank import LowRankParameters, lora_carried_names  # noqa: E402
from trl_dart_es.noise import population  # noqa: E402
from trl_dart_es.perturb import EvolvedParameters  # noqa: E402
from trl_dart_es.rollout.vllm import VLLMRollout, shutdown_engine, start_engine  # noqa: E402
from trl_dart_es.rollout.vllm_lowrank import VLLMLowRankRollout  # noqa: E402
from trl_dart_es.tasks import load_task_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":  # vLLM may spawn helpers that import this script
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--population-size", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--sigma", type=float, default=2e-3)
    parser.add_argument("--paths", nargs="+", default=["full", "lowrank"], choices=["full", "lowrank"])
    parser.add_argument("--output-dir", default=str(ROOT / "docs" / "benchmarks"))
    parser.add_argument("--no-write", action="store_true", help="print only (smoke runs)")
    args = parser.parse_args()
    n, b, t = args.population_size, args.prompts, args.max_new_tokens

    load_before = os.getloadavg()
    started = time.perf_counter()
    model = load_model("embedded:smollm2-135m", dtype=torch.float32).eval()
    tokenizer = load_tokenizer("embedded:smollm2-135m")
    prompts = load_task_dataset("embedded:gsm8k", "train")["prompt"][:b]
    members = population(1234, n)
    z = [float(i) - (n - 1) / 2 for i in range(n)]  # any fitness: the update's cost does not depend on it
    gc = GenerationConfig(
        max_new_tokens=t,
        do_sample=False,
        eos_token_id=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    fixed_length = {"min_tokens": t}  # vLLM SamplingParams: no row stops early, same work in every run

    runs: dict[str, dict[int, list[dict]]] = {}
    threads_after_start: dict[str, dict] = {}
    handover: dict[str, list[dict]] = {}
    machine_threads = torch.get_num_threads()
    for path in args.paths:
        torch.set_num_threads(machine_threads)  # every engine starts from the same count
        if path == "full":  # one weight push per member, one generate of B rows per member
            engine = start_engine(model, cpu_kvcache_space=1, max_model_len=1024)
            params = EvolvedParameters(model, args.sigma, cache_noise=False)
            rollout = VLLMRollout(model, tokenizer, gc, params, engine, generation_kwargs=fixed_length)
        else:  # every member a LoRA adapter, the whole population in one generate
            engine = start_engine(
                model, cpu_kvcache_space=1, max_model_len=1024, max_loras=n, max_lora_rank=1
            )
            params = LowRankParameters(model, args.sigma, rank=1, names=lora_carried_names(model))
            rollout = VLLMLowRankRollout(model, tokenizer, gc, params, engine, generation_kwargs=fixed_length)
        # What vLLM's worker left the process with, and what start_engine's default then set.
        threads_after_start[path] = {"vllm": engine.vllm_threads, "default": torch.get_num_threads()}
        runs[path] = {k: [] for k in args.threads}
        for k in args.threads:  # warm-up per count: first-call allocations, OpenMP pool of that size
            torch.set_num_threads(k)
            rollout.generate_population(prompts[:2], members[:2])
        for r in range(args.repeats):
            order = args.threads if r % 2 == 0 else args.threads[::-1]
            for k in order:
                torch.set_num_threads(k)
                w0, c0 = time.perf_counter(), time.process_time()
                gens = rollout.generate_population(prompts, members)
                w1, c1 = time.perf_counter(), time.process_time()
                params.update(members, z, 1e-6)  # changes the base: the low-rank path pushes it next round
                w2 = time.perf_counter()
                tokens = sum(g.num_tokens for g in gens)
                runs[path][k].append(
                    dict(round=r, generate_s=w1 - w0, generate_cpu_s=c1 - c0, update_s=w2 - w1, tokens=tokens)
                )
                print(f"{path:8s} threads={k} round={r} generate {w1 - w0:6.2f} s  {tokens / (w1 - w0):6.1f} tok/s  "
                      f"update {w2 - w1:5.2f} s", flush=True)  # fmt: skip
        if path == "lowrank":  # handing the factors to vLLM: in memory vs PEFT folders on /dev/shm
            torch.set_num_threads(threads_after_start[path]["default"])
            for r in range(args.repeats):
                for how in ("memory", "files") if r % 2 == 0 else ("files", "memory"):
                    rollout.handover = how
                    t0 = time.perf_counter()
                    requests, folder = rollout._add_adapters(members)
                    t1 = time.perf_counter()
                    rollout._remove_adapters(requests, folder)
                    handover.setdefault(how, []).append(
                        dict(add_s=t1 - t0, remove_s=time.perf_counter() - t1)
                    )
            rollout.handover = "memory"
        shutdown_engine()

    summary: dict[str, dict] = {}
    for path, by_threads in runs.items():
        summary[path] = {}
        for k, rs in by_threads.items():
            gen = statistics.median(x["generate_s"] for x in rs)
            summary[path][str(k)] = dict(
                generate_s_median=gen,
                generate_cpu_s_median=statistics.median(x["generate_cpu_s"] for x in rs),
                update_s_median=statistics.median(x["update_s"] for x in rs),
                step_s_median=statistics.median(x["generate_s"] + x["update_s"] for x in rs),
                tokens=rs[0]["tokens"],
                tokens_per_s=rs[0]["tokens"] / gen,
            )
        summary[path]["fastest_generate_threads"] = min(
            by_threads, key=lambda k: summary[path][str(k)]["generate_s_median"]
        )
        summary[path]["fastest_step_threads"] = min(
            by_threads, key=lambda k: summary[path][str(k)]["step_s_median"]
        )
    import vllm

    result = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": "flock /tmp/heavy.lock .venv/bin/python benchmarks/vllm_threads.py"
        + (f" --repeats {args.repeats}" if args.repeats != 3 else ""),
        "machine": {
            "cpu": cpu_model(),
            "cores_available": len(os.sched_getaffinity(0)),
            "load_average_before_after": [*load_before, *os.getloadavg()],
            "python": platform.python_version(),
            "torch": torch.__version__,
            "vllm": vllm.__version__,
        },
        "workload": dict(
            model="embedded:smollm2-135m (fp32)",
            population_size=n,
            prompts=b,
            rollouts=n * b,
            new_tokens_per_rollout=t,
            decoding="greedy, fixed length (min_tokens)",
            sigma=args.sigma,
            lowrank_rank=1,
            repeats=args.repeats,
            order="interleaved, reversed every round",
        ),  # fmt: skip
        "torch_threads_before_engine_start": machine_threads,
        "torch_threads_after_engine_start": threads_after_start,
        "summary": summary,
        "lowrank_handover_s_median": {
            how: {k: statistics.median(x[k] for x in xs) for k in ("add_s", "remove_s")}
            for how, xs in handover.items()
        },
        "runs": {p: {str(k): v for k, v in rs.items()} for p, rs in runs.items()},
        "total_s": time.perf_counter() - started,
    }
    print(json.dumps(result["summary"], indent=2))
    if not args.no_write:
        names = {"full": "full rank (`dart-es-vllm`: push per member)", "lowrank": "low rank (`dart-es-vllm-lowrank`: adapters)"}  # fmt: skip
        lines = [
            "# vLLM on CPU: torch threads",
            "",
            f"Measured {result['date']} by `{result['command']}` on {result['machine']['cpu']} "
            f"({result['machine']['cores_available']} cores available), torch {torch.__version__}, vLLM "
            f"{vllm.__version__}. 1-minute load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after.",
            "",
            f"Workload: embedded SmolLM2-135M, fp32, N = {n} members x B = {b} GSM8K prompts = {n * b} rollouts of "
            f"exactly {t} tokens, greedy. Thread counts interleaved (order reversed every round), {args.repeats} "
            "rounds after one warm-up each; medians. `generate` is `generate_population` (one ES step's "
            "generation); `update` is the ES update that follows it, on the same threads.",
            "",
            "| path | torch threads | generate s (median) | tokens/s | generate CPU s | update s (median) | generate + update s (median) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for path, s in summary.items():
            for k in args.threads:
                x = s[str(k)]
                lines.append(
                    f"| {names[path]} | {k} | {x['generate_s_median']:.2f} | {x['tokens_per_s']:.1f} | "
                    f"{x['generate_cpu_s_median']:.2f} | {x['update_s_median']:.2f} | {x['step_s_median']:.2f} |"
                )
        lines.append("")
        for path, s in summary.items():
            lo, hi = s[str(args.threads[0])], s[str(args.threads[-1])]
            lines.append(
                f"- {names[path]}: {args.threads[-1]} threads take {hi['generate_s_median'] / lo['generate_s_median']:.2f}x "
                f"the generate time of {args.threads[0]}, {hi['update_s_median'] / lo['update_s_median']:.2f}x the "
                f"update time and {hi['step_s_median'] / lo['step_s_median']:.2f}x generate + update. Fastest: "
                f"generate on {s['fastest_generate_threads']} thread(s), generate + update on "
                f"{s['fastest_step_threads']}. Torch threads once vLLM had started (from {machine_threads}): "
                f"{threads_after_start[path]['vllm']}; then set by `start_engine`'s default: "
                f"{threads_after_start[path]['default']}."
            )  # fmt: skip
        for how, x in result["lowrank_handover_s_median"].items():
            lines.append(
                f"- Low rank, handing the {n} members' factors to vLLM ({how}): add {x['add_s'] * 1e3:.0f} ms, "
                f"remove {x['remove_s'] * 1e3:.0f} ms (medians, default threads)."
            )
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "vllm_threads.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "vllm_threads.md").write_text("\n".join(lines) + "\n")
        print(f"wrote {out / 'vllm_threads.json'} and .md")
