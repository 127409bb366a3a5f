"""Micro-benchmark of the ES bookkeeping on the embedded model: noise, perturb, restore, update.

Everything here is what an ES step costs *besides* generation. Run once, on an otherwise idle machine if
possible (the load average is recorded with the results):

    .venv/bin/python benchmarks/es_bookkeeping.py            # writes docs/benchmarks/es_bookkeeping.{json,md}

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


def timed(fn, repeats: int, setup=None) -> dict[str, float]:
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "repeats": repeats}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--random-init", action="store_true", help="build the model from its config")
    parser.add_argument("--population", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", default="docs/benchmarks")
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

    def record(key: str, what: str, timing: dict[str, float], passes: int = 1) -> None:
        timing = dict(timing)
        timing["ns_per_param"] = timing["median_s"] / passes / num_params * 1e9
        timing["what"] = what
        results[key] = timing
        print(
            f"{key:32s} {timing['median_s']:8.3f} s  ({timing['ns_per_param']:.2f} ns/param)  {what}",
            flush=True,
        )

    # ---- noise alternatives: one full pass over the model's parameters, draw only
    def old_randn():
        for name, p in named:
            gen = torch.Generator().manual_seed(tensor_seed(seed, name))
            torch.randn(p.shape, generator=gen)

    record(
        "noise_old_torch_randn",
        "per-tensor torch.Generator + torch.randn (allocates)",
        timed(old_randn, reps),
    )

    bufs = [torch.empty(p.shape, dtype=torch.float32) for _, p in named]

    def randn_out():
        for (name, p), buf in zip(named, bufs, strict=True):
            gen = torch.Generator().manual_seed(tensor_seed(seed, name))
            torch.randn(p.shape, generator=gen, out=buf)

    record(
        "noise_torch_randn_out", "per-tensor torch.randn into preallocated buffers", timed(randn_out, reps)
    )

    if not args.skip_numpy:
        for bitgen in ("PCG64", "SFC64", "Philox"):

            def numpy_draw(bitgen=bitgen):
                for (name, _), buf in zip(named, bufs, strict=True):
                    rng = np.random.Generator(getattr(np.random, bitgen)(tensor_seed(seed, name)))
                    rng.standard_normal(dtype=np.float32, out=buf.numpy())

            record(
                f"noise_numpy_{bitgen.lower()}",
                f"numpy {bitgen} standard_normal(float32, out=...)",
                timed(numpy_draw, 2),
            )

    def chunked():
        for (name, p), buf in zip(named, bufs, strict=True):
            gaussian(seed, name, p.shape, out=buf)

    threads = noise.get_num_threads()
    record(
        "noise_chosen", f"gaussian(): 2**18-element chunks, normal_, {threads} threads", timed(chunked, reps)
    )
    noise.set_num_threads(1)
    record("noise_chosen_1_thread", "gaussian(), 1 thread", timed(chunked, reps))
    noise.set_num_threads(None)
    bufs.clear()  # free them before the EvolvedParameters runs

    # ---- the old perturbation: draw per tensor and add in place
    def old_perturb():
        with torch.no_grad():
            for name, p in named:
                gen = torch.Generator().manual_seed(tensor_seed(seed, name))
                p.add_(torch.randn(p.shape, generator=gen), alpha=sigma)

    record(
        "perturb_old", "per-tensor torch.randn + add_ in place (the earlier probe)", timed(old_perturb, reps)
    )

    # ---- EvolvedParameters
    members = population(seed, args.population)
    z = np.linspace(-1.5, 1.5, args.population)
    for cache in (False, True):
        params = EvolvedParameters(model, sigma, cache_noise=cache)
        if cache:
            # First visit of each member fills the cache; perturbing again reads it.
            record(
                "perturb_cache_fill",
                f"perturb, drawing into the cache (mean of {args.population} members)",
                timed(lambda p=params: [p.perturb(m) for m in members], 1),
                passes=args.population,
            )
            record(
                "perturb_from_cache",
                "perturb from cached noise",
                timed(lambda p=params: p.perturb(members[0]), reps),
            )
            record(
                "update_cache",
                f"update, N={args.population}, all noise cached",
                timed(lambda p=params: p.update(members, z, 1e-4), 1),
            )
        else:
            record(
                "perturb_nocache",
                "perturb, noise drawn and added chunk by chunk",
                timed(lambda p=params: p.perturb(members[0]), reps),
            )
            record(
                "restore",
                "restore (copy fp32 master into the parameters)",
                timed(params.restore, reps, setup=lambda p=params: p.perturb(members[1])),
            )
            record(
                "update_nocache",
                f"update, N={args.population}, noise redrawn",
                timed(lambda p=params: p.update(members, z, 1e-4), 2),
            )
        params.restore()
        del params

    naive = EvolvedParameters(model, sigma, exact_restore=False, cache_noise=False)
    record(
        "perturb_reference_mode",
        "perturb with exact_restore=False (in place, no master copy)",
        timed(lambda: naive.perturb(members[0]), reps),
    )
    naive.restore()

    out = {
        "command": "python benchmarks/es_bookkeeping.py " + " ".join(sys.argv[1:]),
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
        "| operation | seconds per pass | ns / parameter | what |",
        "| --- | ---: | ---: | --- |",
    ]
    for key, r in out["results"].items():
        per_pass = r["ns_per_param"] * out["num_parameters"] / 1e9
        lines.append(f"| `{key}` | {per_pass:.3f} | {r['ns_per_param']:.2f} | {r['what']} |")
    lines.append("")
    lines.append("`update_*` rows are per update (all N members), not per member.")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
