"""Micro-benchmark of the ES bookkeeping on the embedded model: noise, perturb, restore, update.

Everything here is what an ES step costs *besides* generation. Run once, on an otherwise idle machine if
possible (the load average is recorded with the results):

    .venv/bin/python benchmarks/es_bookkeeping.py            # writes results/es_bookkeeping.{json,md}

The model comes from ``trl_dart_es.embedded.resolve_model_path("embedded:smollm2-135m")``; with
``--random-init`` (or when the embedded model is unavailable) a Llama of the same config is built with
random weights: only the parameter shapes matter here. Takes 1-3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from trl_dart_es import noise
from trl_dart_es.noise import gaussian, population, tensor_seed
from trl_dart_es.perturb import EvolvedParameters

SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


def load_model(random_init: bool):
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if not random_init:
        try:
            from trl_dart_es.embedded import resolve_model_path

            path = resolve_model_path("embedded:smollm2-135m")
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            return model, f"embedded:smollm2-135m ({path})"
        except Exception as exc:  # the embedded model is optional for a shape benchmark
            print(f"embedded model unavailable ({exc!r}); using random weights", file=sys.stderr)
    try:
        from trl_dart_es.embedded import resolve_model_path

        config = AutoConfig.from_pretrained(resolve_model_path("embedded:smollm2-135m"))
    except Exception:
        config = LlamaConfig(**SMOLLM2_135M)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float(), "random-init Llama with the SmolLM2-135M config"


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--random-init", action="store_true", help="build the model from its config")
    parser.add_argument("--population", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", default="results")
    parser.add_argument("--skip-numpy", action="store_true", help="skip the (slow) numpy alternatives")
    args = parser.parse_args()

    load_avg_start = os.getloadavg()
    t0 = time.perf_counter()
    model, model_desc = load_model(args.random_init)
    model.requires_grad_(True)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    num_params = sum(p.numel() for _, p in named)
    sigma, seed = 1e-3, 1234
    results: dict[str, dict] = {}
    reps = args.repeats

    def record(key: str, what: str, times: list[float], passes: int = 1) -> None:
        timing = {"median_s": statistics.median(times), "min_s": min(times), "repeats": len(times)}
        timing["ns_per_param"] = timing["median_s"] / passes / num_params * 1e9
        timing["min_ns_per_param"] = timing["min_s"] / passes / num_params * 1e9
        timing["passes"] = passes
        timing["what"] = what
        results[key] = timing
        print(
            f"{key:30s} median {timing['median_s'] / passes:7.3f} s  min {timing['min_s'] / passes:7.3f} s"
            f"  ({timing['ns_per_param']:.2f} ns/param)  {what}",
            flush=True,
        )

    # ---- noise alternatives: one full pass over the model's parameters, draw only. The candidates run
    # round-robin, so load from other processes on a shared machine hits them alike.
    bufs = [torch.empty(p.shape, dtype=torch.float32) for _, p in named]
    threads = noise.get_num_threads()

    def old_randn():
        for name, p in named:
            gen = torch.Generator().manual_seed(tensor_seed(seed, name))
            torch.randn(p.shape, generator=gen)

    def randn_out():
        for (name, p), buf in zip(named, bufs, strict=True):
            gen = torch.Generator().manual_seed(tensor_seed(seed, name))
            torch.randn(p.shape, generator=gen, out=buf)

    def numpy_draw(bitgen: str):
        for (name, _), buf in zip(named, bufs, strict=True):
            rng = np.random.Generator(getattr(np.random, bitgen)(tensor_seed(seed, name)))
            rng.standard_normal(dtype=np.float32, out=buf.numpy())

    def chunked(num_threads: int | None):
        noise.set_num_threads(num_threads)
        try:
            for (name, p), buf in zip(named, bufs, strict=True):
                gaussian(seed, name, p.shape, out=buf)
        finally:
            noise.set_num_threads(None)

    candidates = {
        "noise_old_torch_randn": ("per-tensor torch.Generator + torch.randn (allocates)", old_randn),
        "noise_torch_randn_out": ("per-tensor torch.randn into preallocated buffers", randn_out),
        "noise_chosen": (
            f"gaussian(): 2**18-element chunks, Tensor.normal_, {threads} threads",
            lambda: chunked(None),
        ),
        "noise_chosen_1_thread": ("gaussian(), 1 thread", lambda: chunked(1)),
    }
    if not args.skip_numpy:
        for bitgen in ("PCG64", "SFC64", "Philox"):
            candidates[f"noise_numpy_{bitgen.lower()}"] = (
                f"numpy {bitgen} standard_normal(float32, out=...) per tensor",
                lambda bitgen=bitgen: numpy_draw(bitgen),
            )
    times: dict[str, list[float]] = {k: [] for k in candidates}
    for _ in range(reps):
        for key, (_, fn) in candidates.items():
            times[key] += timed(fn, 1)
    for key, (what, _) in candidates.items():
        record(key, what, times[key])
    bufs.clear()  # free them before the EvolvedParameters runs

    # ---- perturbation: the earlier probe's way against EvolvedParameters, interleaved as well
    def old_perturb():
        with torch.no_grad():
            for name, p in named:
                gen = torch.Generator().manual_seed(tensor_seed(seed, name))
                p.add_(torch.randn(p.shape, generator=gen), alpha=sigma)

    members = population(seed, args.population)
    z = np.linspace(-1.5, 1.5, args.population)
    exact = EvolvedParameters(model, sigma, cache_noise=False)
    reference = EvolvedParameters(model, sigma, exact_restore=False, cache_noise=False)
    times = {"perturb_old": [], "perturb_nocache": [], "perturb_reference_mode": [], "restore": []}
    for _ in range(reps):
        times["perturb_old"] += timed(old_perturb, 1)
        exact.sync_from_model()
        times["perturb_nocache"] += timed(lambda: exact.perturb(members[0]), 1)
        times["restore"] += timed(exact.restore, 1)
        times["perturb_reference_mode"] += timed(lambda: reference.perturb(members[1]), 1)
        reference.restore()
    record("perturb_old", "per-tensor torch.randn + add_ in place (the earlier probe)", times["perturb_old"])
    record("perturb_nocache", "perturb: noise drawn and written chunk by chunk", times["perturb_nocache"])
    record(
        "perturb_reference_mode",
        "perturb with exact_restore=False (in place, no master copy)",
        times["perturb_reference_mode"],
    )
    record("restore", "restore (copy the fp32 master into the parameters)", times["restore"])
    record(
        "update_nocache",
        f"update, N={args.population}, noise redrawn (per update)",
        timed(lambda: exact.update(members, z, 1e-4), 2),
    )
    exact = reference = None  # free the master copy before the cached run

    # ---- with the noise cache: two steps, the second reuses the first step's buffers
    cached = EvolvedParameters(model, sigma, cache_noise=True)
    n = args.population
    fill_first = timed(lambda: [cached.perturb(m) for m in members], 1)
    update_times = timed(lambda: cached.update(members, z, 1e-4), 1)
    fill_steady = timed(lambda: [cached.perturb(m) for m in members], 1)
    from_cache = timed(lambda: cached.perturb(members[0]), reps)
    update_times += timed(lambda: cached.update(members, z, 1e-4), 1)
    record(
        "perturb_cache_fill_first_step", "perturb drawing into newly allocated cache memory", fill_first, n
    )
    record(
        "perturb_cache_fill",
        "perturb drawing into the cache, buffers reused from the last step",
        fill_steady,
        n,
    )
    record("perturb_from_cache", "perturb from cached noise (member evaluated again)", from_cache)
    record("update_cache", f"update, N={n}, all noise cached (per update)", update_times)
    cached.restore()

    out = {
        "command": " ".join([".venv/bin/python benchmarks/es_bookkeeping.py", *sys.argv[1:]]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": _cpu_name(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "noise_threads": threads,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
            "load_average_start": load_avg_start,
            "load_average_end": os.getloadavg(),
        },
        "model": model_desc,
        "num_parameters": num_params,
        "num_tensors": len(named),
        "population": args.population,
        "results": results,
        "total_runtime_s": time.perf_counter() - t0,
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "es_bookkeeping.json").write_text(json.dumps(out, indent=2) + "\n")
    (out_dir / "es_bookkeeping.md").write_text(_markdown(out))
    print(f"wrote {out_dir / 'es_bookkeeping.json'} and .md in {out['total_runtime_s']:.0f} s")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _markdown(out: dict) -> str:
    m = out["machine"]
    lines = [
        "# ES bookkeeping micro-benchmark",
        "",
        f"- command: `{out['command']}`",
        f"- date: {out['date']}",
        f"- machine: {m['processor']}, {m['cpu_count']} cores, {m['platform']}; torch {m['torch']}, "
        f"numpy {m['numpy']}; load average at start {m['load_average_start'][0]:.2f}, at end "
        f"{m['load_average_end'][0]:.2f} (shared machine)",
        f"- model: {out['model']}: {out['num_parameters']:,} trainable parameters in {out['num_tensors']} tensors",
        f"- one pass = every trainable parameter once; median of the repeats; N = {out['population']}",
        "",
        "| operation | s per pass (median) | s per pass (min) | ns / parameter (median) | what |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for key, r in out["results"].items():
        med, low = r["median_s"] / r["passes"], r["min_s"] / r["passes"]
        lines.append(f"| `{key}` | {med:.3f} | {low:.3f} | {r['ns_per_param']:.2f} | {r['what']} |")
    lines.append("")
    lines.append(
        "`update_*` rows are per update (all N members together); `perturb_cache_fill*` rows are per member."
    )
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
