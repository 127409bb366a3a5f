"""vLLM on CPU: 1 against 2 torch threads, on both vLLM ES paths, interleaved so that machine noise cancels.

The vLLM engine runs inside the trainer's process on CPU, so both share torch's intra-op threads (vLLM's own
serving default is 1 thread). This probe measures which count the process should use. Workload: the quickstart
one (embedded SmolLM2-135M, fp32, N = 8 members x B = 8 GSM8K prompts, up to 40 new tokens, greedy). Each path
runs in a fresh process with one engine (a second engine in the same process measured differently); the
thread counts alternate within it (1, 2 / 2, 1 / ...), `--repeats` rounds after one warm-up per count. Greedy
decoding with the same weights gives the same tokens at every thread count, so every run does the same work.
Each run times `generate_population` (what an ES step generates) and then the ES update (the rest of the
step also runs on these threads). Last, the low-rank path's two ways of handing the members' factors to vLLM
(in memory, or PEFT folders on /dev/shm) are timed against each other. Run under the heavy-job lock, on an
otherwise idle machine:

    flock /tmp/heavy.lock .venv/bin/python benchmarks/vllm_threads.py   # ~12 min on 2 cores
    # writes results/vllm_threads.{json,md}
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "OMP_NUM_THREADS" in os.environ:  # it would pin vLLM's (and torch's) thread count: nothing to compare
    raise SystemExit("unset OMP_NUM_THREADS: this probe sets the torch threads itself")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NAMES = {
    "full": "full rank (`dart-es-vllm`: push per member)",
    "lowrank": "low rank (`dart-es-vllm-lowrank`: adapters)",
}


def measure(path: str, args: argparse.Namespace) -> dict:
    """One path, in this process: one engine, the thread counts interleaved."""
    from trl_dart_es.embedded import load_model, load_tokenizer
    from trl_dart_es.lowrank import LowRankParameters, lora_carried_names
    from trl_dart_es.noise import population
    from trl_dart_es.perturb import EvolvedParameters
    from trl_dart_es.rollout.transformers import greedy_generation_config
    from trl_dart_es.rollout.vllm import VLLMRollout, shutdown_engine, start_engine
    from trl_dart_es.rollout.vllm_lowrank import VLLMLowRankRollout
    from trl_dart_es.tasks import load_task_dataset

    n, b, t = args.population_size, args.prompts, args.max_new_tokens
    model = load_model("embedded:smollm2-135m", dtype=torch.float32).eval()
    tokenizer = load_tokenizer("embedded:smollm2-135m")
    prompts = load_task_dataset("embedded:gsm8k", "train")["prompt"][:b]
    members = population(1234, n)
    z = [float(i) - (n - 1) / 2 for i in range(n)]  # any fitness: the update's cost does not depend on it
    gc = greedy_generation_config(tokenizer, t)
    extra = {"min_tokens": t} if args.fixed_length else None  # vLLM SamplingParams: no row stops early

    before = torch.get_num_threads()
    if path == "full":  # one weight push per member, one generate of B rows per member
        engine = start_engine(model, cpu_kvcache_space=1, max_model_len=1024)
        params = EvolvedParameters(model, args.sigma, cache_noise=False)
        rollout = VLLMRollout(model, tokenizer, gc, params, engine, generation_kwargs=extra)
    else:  # every member a LoRA adapter, the whole population in one generate
        engine = start_engine(model, cpu_kvcache_space=1, max_model_len=1024, max_loras=n, max_lora_rank=1)
        params = LowRankParameters(model, args.sigma, rank=1, names=lora_carried_names(model))
        rollout = VLLMLowRankRollout(model, tokenizer, gc, params, engine, generation_kwargs=extra)
    # Before the engine, once vLLM had started, and as start_engine's default then set them.
    threads = {"before": before, "vllm": engine.vllm_threads, "default": torch.get_num_threads()}

    runs: dict[str, list[dict]] = {str(k): [] for k in args.threads}
    for k in args.threads:  # warm-up per count: first-call allocations, OpenMP pool of that size
        torch.set_num_threads(k)
        rollout.generate_population(prompts[:2], members[:2])
    for r in range(args.repeats):
        for k in args.threads if r % 2 == 0 else args.threads[::-1]:
            torch.set_num_threads(k)
            w0, c0 = time.perf_counter(), time.process_time()
            gens = rollout.generate_population(prompts, members)
            w1, c1 = time.perf_counter(), time.process_time()
            params.update(members, z, 1e-6)  # changes the base: the low-rank path pushes it next round
            w2 = time.perf_counter()
            tokens = sum(g.num_tokens for g in gens)
            runs[str(k)].append(
                dict(round=r, generate_s=w1 - w0, generate_cpu_s=c1 - c0, update_s=w2 - w1, tokens=tokens)
            )
            print(f"{path:8s} threads={k} round={r} generate {w1 - w0:6.2f} s ({c1 - c0:6.2f} CPU s)  "
                  f"{tokens / (w1 - w0):6.1f} tok/s  update {w2 - w1:5.2f} s", flush=True)  # fmt: skip

    handover: dict[str, list[dict]] = {}
    if path == "lowrank":  # handing the factors to vLLM: in memory vs PEFT folders on /dev/shm
        torch.set_num_threads(threads["default"])
        for r in range(args.repeats):
            for how in ("memory", "files") if r % 2 == 0 else ("files", "memory"):
                rollout.handover = how
                t0 = time.perf_counter()
                requests, folder = rollout._adapter_requests(members)
                rollout._add_adapters(members, requests)
                t1 = time.perf_counter()
                rollout._remove_adapters(requests, folder)
                handover.setdefault(how, []).append(dict(add_s=t1 - t0, remove_s=time.perf_counter() - t1))
    shutdown_engine()
    return {"runs": runs, "threads": threads, "handover": handover}


def summarize(runs: dict[str, list[dict]]) -> dict:
    out: dict = {}
    for k, rs in runs.items():
        gen = statistics.median(x["generate_s"] for x in rs)
        out[k] = dict(
            generate_s_median=gen,
            generate_cpu_s_median=statistics.median(x["generate_cpu_s"] for x in rs),
            update_s_median=statistics.median(x["update_s"] for x in rs),
            step_s_median=statistics.median(x["generate_s"] + x["update_s"] for x in rs),
            tokens=rs[0]["tokens"],
            tokens_per_s=rs[0]["tokens"] / gen,
        )
    out["fastest_generate_threads"] = int(min(runs, key=lambda k: out[k]["generate_s_median"]))
    out["fastest_step_threads"] = int(min(runs, key=lambda k: out[k]["step_s_median"]))
    return out


def render(result: dict) -> str:
    m, w = result["machine"], result["workload"]
    load = m["load_average_before_after"]
    ks = [str(k) for k in w["threads"]]
    lines = [
        "# vLLM on CPU: torch threads",
        "",
        f"Measured {result['date']} by `{result['command']}` on {m['cpu']} ({m['cores_available']} cores "
        f"available), torch {m['torch']}, vLLM {m['vllm']}. 1-minute load average {load[0]:.2f} before, "
        f"{load[3]:.2f} after.",
        "",
        f"Workload: embedded SmolLM2-135M, fp32, N = {w['population_size']} members x B = {w['prompts']} GSM8K "
        f"prompts = {w['rollouts']} rollouts of up to {w['new_tokens_per_rollout']} tokens ({w['decoding']}). "
        f"One fresh process per path; thread counts interleaved (order reversed every round), {w['repeats']} "
        "rounds after one warm-up each; medians. `generate` is `generate_population` (one ES step's "
        "generation); `update` is the ES update that follows it, on the same threads.",
        "",
        "| path | torch threads | generate s | tokens/s | generate CPU s | update s | generate + update s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for path, s in result["summary"].items():
        for k in ks:
            x = s[k]
            lines.append(
                f"| {NAMES[path]} | {k} | {x['generate_s_median']:.2f} | {x['tokens_per_s']:.1f} | "
                f"{x['generate_cpu_s_median']:.2f} | {x['update_s_median']:.2f} | {x['step_s_median']:.2f} |"
            )
    lines.append("")
    for path, s in result["summary"].items():
        lo, hi, th = s[ks[0]], s[ks[-1]], result["threads"][path]
        lines.append(
            f"- {NAMES[path]}: {ks[-1]} threads take {hi['generate_s_median'] / lo['generate_s_median']:.2f}x the "
            f"generate time of {ks[0]}, {hi['update_s_median'] / lo['update_s_median']:.2f}x the update time and "
            f"{hi['step_s_median'] / lo['step_s_median']:.2f}x generate + update. Fastest: generate on "
            f"{s['fastest_generate_threads']} thread(s), generate + update on {s['fastest_step_threads']}. Torch "
            f"threads {th['before']} before the engine, {th['vllm']} once vLLM had started, {th['default']} as "
            "`start_engine`'s default sets them."
        )  # fmt: skip
    for how, x in result["lowrank_handover_s_median"].items():
        lines.append(
            f"- Low rank, handing the {w['population_size']} members' factors to vLLM ({how}): add "
            f"{x['add_s'] * 1e3:.0f} ms, remove {x['remove_s'] * 1e3:.0f} ms (medians, default threads)."
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # vLLM may spawn helpers that import this script
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--population-size", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--sigma", type=float, default=2e-3)
    parser.add_argument("--paths", nargs="+", default=["full", "lowrank"], choices=["full", "lowrank"])
    parser.add_argument(
        "--fixed-length", action="store_true", help="every row decodes exactly --max-new-tokens"
    )
    parser.add_argument("--output-dir", default=str(ROOT / "results"))
    parser.add_argument("--no-write", action="store_true", help="print only (smoke runs)")
    parser.add_argument("--child-json", help=argparse.SUPPRESS)  # internal: measure one path, write its JSON
    args = parser.parse_args()
    if args.child_json:
        Path(args.child_json).write_text(json.dumps(measure(args.paths[0], args)))
        raise SystemExit(0)

    load_before, started = os.getloadavg(), time.perf_counter()
    parts = {}
    for path in args.paths:  # a fresh process per path
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "part.json")
            cmd = [sys.executable, __file__, "--paths", path, "--threads", *map(str, args.threads),
                   "--repeats", str(args.repeats), "--population-size", str(args.population_size),
                   "--prompts", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens),
                   "--sigma", str(args.sigma), "--child-json", out]  # fmt: skip
            subprocess.run(cmd + (["--fixed-length"] if args.fixed_length else []), check=True)
            parts[path] = json.loads(Path(out).read_text())

    import vllm

    n = args.population_size
    defaults = ["--threads", "1", "2", "--repeats", "4", "--paths", "full", "lowrank"]
    given = [a for a in sys.argv[1:] if a not in ("--no-write",)]
    result = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": "flock /tmp/heavy.lock .venv/bin/python benchmarks/vllm_threads.py"
        + ("" if given in ([], defaults) else " " + " ".join(given)),
        "machine": {
            "cpu": next(
                (
                    ln.split(":", 1)[1].strip()
                    for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")
                ),
                platform.processor(),
            ),  # fmt: skip
            "cores_available": len(os.sched_getaffinity(0)),
            "load_average_before_after": [*load_before, *os.getloadavg()],
            "python": platform.python_version(),
            "torch": torch.__version__,
            "vllm": vllm.__version__,
        },
        "workload": dict(
            model="embedded:smollm2-135m (fp32)",
            population_size=n,
            prompts=args.prompts,
            rollouts=n * args.prompts,
            new_tokens_per_rollout=args.max_new_tokens,
            decoding="greedy, " + ("fixed length (min_tokens)" if args.fixed_length else "stops at EOS"),
            sigma=args.sigma,
            lowrank_rank=1,
            threads=args.threads,
            repeats=args.repeats,
            order="interleaved, reversed every round; one process per path",
        ),
        "summary": {p: summarize(part["runs"]) for p, part in parts.items()},
        "threads": {p: part["threads"] for p, part in parts.items()},
        "lowrank_handover_s_median": {
            how: {k: statistics.median(x[k] for x in xs) for k in ("add_s", "remove_s")}
            for how, xs in parts.get("lowrank", {}).get("handover", {}).items()
        },
        "runs": {p: part["runs"] for p, part in parts.items()},
        "total_s": time.perf_counter() - started,
    }
    print(render(result))
    if not args.no_write:
        out_dir = Path(args.output_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "vllm_threads.json").write_text(json.dumps(result, indent=2) + "\n")
        (out_dir / "vllm_threads.md").write_text(render(result))
        print(f"wrote {out_dir / 'vllm_threads.json'} and .md")
