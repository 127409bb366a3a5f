"""DART-ES step time, generation throughput and peak memory: vLLM backend vs transformers backend.

Both backends run the same DART-ES steps (same model, data, seed, population and batch: the quickstart
settings from recipes/configs/quickstart_fullrank.yaml) one after the other, each in its own child process so that
peak memory is measured per backend. Each child runs one warm-up step and then `--steps` measured steps.

    flock /tmp/heavy.lock .venv/bin/python benchmarks/vllm_vs_transformers.py            # ~15 min on 2 cores
    flock /tmp/heavy.lock .venv/bin/python benchmarks/vllm_vs_transformers.py --steps 1 --no-write

Writes results/vllm_vs_transformers.json and .md. Per step it records wall time and the process's
CPU time (user + system, children included: robust when other jobs share the cores), the split of the
generation phase into perturbing the HF model, pushing weights into vLLM and decoding, tokens/s, and the
peak RSS of the process and its children (sampled every 0.2 s).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "configs" / "quickstart_fullrank.yaml"
# Used when the quickstart config is missing a field.
FALLBACK = dict(population_size=8, per_device_train_batch_size=32, max_completion_length=64, sigma=2e-3)
BACKENDS = ("transformers", "vllm")


# ----------------------------------------------------------------------------------------------- child
class PeakRSS:
    """Peak resident memory of this process plus its children, sampled in a background thread."""

    def __init__(self, interval: float = 0.2):
        import psutil

        self._proc = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def sample(self) -> int:
        total = self._proc.memory_info().rss
        for child in self._proc.children(recursive=True):
            try:
                total += child.memory_info().rss
            except Exception:  # a child that just exited
                pass
        self.peak = max(self.peak, total)
        return total

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.sample()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.peak


def _cpu_seconds() -> float:
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run_backend(backend: str, settings: dict, steps: int) -> dict:
    """Warm-up + `steps` DART-ES steps on one backend, in this process; returns the measurements."""

    from trl_dart_es import DartESConfig, DartESTrainer
    from trl_dart_es.rewards import gsm8k_accuracy_reward, gsm8k_format_reward
    from trl_dart_es.tasks import load_task_dataset

    memory = PeakRSS()
    t0 = time.perf_counter()
    args = DartESConfig(
        output_dir=str(REPO / "outputs" / "bench_vllm" / backend),
        use_vllm=backend == "vllm",
        vllm_cpu_kvcache_space=settings["vllm_cpu_kvcache_space"],
        vllm_max_model_length=settings["vllm_max_model_length"],
        population_size=settings["population_size"],
        per_device_train_batch_size=settings["per_device_train_batch_size"],
        max_completion_length=settings["max_completion_length"],
        sigma=settings["sigma"],
        learning_rate=settings["learning_rate"],
        reward_weights=settings["reward_weights"],
        max_steps=steps + 1,
        use_cpu=True,
        seed=settings["seed"],
        model_init_kwargs={"dtype": "float32"},
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
    )
    trainer = DartESTrainer(
        model=settings["model"],
        reward_funcs=[gsm8k_accuracy_reward, gsm8k_format_reward],
        args=args,
        train_dataset=load_task_dataset(settings["dataset"], "train"),
    )
    setup_s = time.perf_counter() - t0

    # Time the phases inside the generation call: perturbing the HF model, pushing weights, decoding.
    phases = {"perturb_s": 0.0, "push_s": 0.0}
    es_params = trainer.es_params
    perturb = es_params.perturb

    def timed_perturb(member):
        t = time.perf_counter()
        perturb(member)
        phases["perturb_s"] += time.perf_counter() - t

    es_params.perturb = timed_perturb
    steps_out = []
    step = trainer.training_step

    def timed_step(model, inputs, num_items_in_batch=None):
        phases.update(perturb_s=0.0, push_s=0.0)
        pushes_before = trainer.rollout.stats["push_s"] if backend == "vllm" else 0.0
        wall, cpu = time.perf_counter(), _cpu_seconds()
        loss = step(model, inputs, num_items_in_batch)
        wall, cpu = time.perf_counter() - wall, _cpu_seconds() - cpu
        m = trainer._metrics
        gen_s, tokens_per_s = m["time/generation"][-1], m["tokens_per_s"][-1]
        push_s = (trainer.rollout.stats["push_s"] - pushes_before) if backend == "vllm" else 0.0
        tokens = tokens_per_s * gen_s
        decode_s = gen_s - phases["perturb_s"] - push_s
        steps_out.append(
            dict(
                step_s=wall,
                cpu_s=cpu,
                generation_s=gen_s,
                perturb_s=phases["perturb_s"],
                push_s=push_s,
                decode_s=decode_s,
                reward_s=m["time/reward"][-1],
                update_s=m["time/es"][-1],
                tokens=int(round(tokens)),
                tokens_per_s=tokens / gen_s if gen_s else 0.0,
                decode_tokens_per_s=tokens / decode_s if decode_s > 0 else 0.0,
                mean_reward=m["reward"][-1],
            )
        )
        print(f"[{backend}] step {len(steps_out)}: {steps_out[-1]}", flush=True)
        return loss

    trainer.training_step = timed_step
    trainer.train()
    peak = memory.stop()
    return dict(
        backend=backend,
        setup_s=setup_s,
        warmup=steps_out[0],
        steps=steps_out[1:],
        peak_rss_gb=peak / 2**30,
        final_weights_sum=float(sum(p.double().sum() for p in trainer.model.parameters())),
    )


# ---------------------------------------------------------------------------------------------- parent
def quickstart_settings() -> dict:
    import yaml

    cfg = yaml.safe_load(QUICKSTART.read_text()) if QUICKSTART.exists() else {}
    s = dict(
        model=cfg.get("model_name_or_path", "embedded:smollm2-135m"),
        dataset=cfg.get("dataset_name", "embedded:gsm8k"),
        seed=cfg.get("seed", 0),
        learning_rate=cfg.get("learning_rate", 1e-3),
        reward_weights=cfg.get("reward_weights", [1.0, 0.1]),
        vllm_cpu_kvcache_space=2,
        vllm_max_model_length=1024,
    )
    for key, value in FALLBACK.items():
        s[key] = cfg.get(key, value)
    return s


def machine() -> dict:
    import psutil
    import torch

    from trl_dart_es.benchmark import cpu_model

    cpu = cpu_model()
    try:
        import vllm

        vllm_version = vllm.__version__
    except ImportError:
        vllm_version = None
    return dict(
        cpu=cpu,
        cores=os.cpu_count(),
        ram_gb=round(psutil.virtual_memory().total / 2**30, 1),
        python=platform.python_version(),
        torch=torch.__version__,
        vllm=vllm_version,
        load_average_at_start=os.getloadavg(),
    )


def summarize(result: dict) -> dict:
    steps = result["steps"]

    def mean(key):
        return sum(s[key] for s in steps) / len(steps)

    keys = ["step_s", "cpu_s", "generation_s", "perturb_s", "push_s", "decode_s", "update_s", "tokens_per_s"]
    out = {k: mean(k) for k in keys}
    out["decode_tokens_per_s"] = sum(s["tokens"] for s in steps) / sum(s["decode_s"] for s in steps)
    out["peak_rss_gb"] = result["peak_rss_gb"]
    return out


def to_markdown(report: dict) -> str:
    s, m = report["settings"], report["machine"]
    t, v = report["summary"]["transformers"], report["summary"]["vllm"]
    rows = [
        ("ES step, wall (s)", "step_s", "{:.1f}"),
        ("ES step, CPU time (s)", "cpu_s", "{:.1f}"),
        ("generation phase (s)", "generation_s", "{:.1f}"),
        ("- perturb HF model (s)", "perturb_s", "{:.1f}"),
        ("- push weights into vLLM (s)", "push_s", "{:.1f}"),
        ("- decode (s)", "decode_s", "{:.1f}"),
        ("ES update (s)", "update_s", "{:.1f}"),
        ("tokens/s, generation phase", "tokens_per_s", "{:.0f}"),
        ("tokens/s, decoding only", "decode_tokens_per_s", "{:.0f}"),
        ("peak RSS incl. children (GB)", "peak_rss_gb", "{:.2f}"),
    ]
    lines = [
        "# vLLM vs transformers backend: DART-ES step on CPU",
        "",
        f"Command: `{report['command']}`  ",
        f"Date: {report['date']}  ",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gb']} GB RAM, shared with other jobs "
        f"(load average at start {m['load_average_at_start'][0]:.1f}); torch {m['torch']}, vllm {m['vllm']}.",
        "",
        f"Settings: {s['model']} fp32, {s['dataset']}, N={s['population_size']} members, "
        f"B={s['per_device_train_batch_size']} problems, max {s['max_completion_length']} new tokens, greedy, "
        f"σ={s['sigma']}; mean of {report['steps']} steps after one warm-up step.",
        "",
        "| | transformers | vLLM | vLLM / transformers |",
        "| --- | ---: | ---: | ---: |",
    ]
    for label, key, fmt in rows:
        ratio = v[key] / t[key] if t[key] else float("nan")
        lines.append(f"| {label} | {fmt.format(t[key])} | {fmt.format(v[key])} | {ratio:.2f} |")
    lines += ["", report["verdict"], ""]
    return "\n".join(lines)


def verdict(summary: dict) -> str:
    t, v = summary["transformers"], summary["vllm"]
    ratio = v["step_s"] / t["step_s"]
    cpu_ratio = v["cpu_s"] / t["cpu_s"]
    costs = {
        "perturbing the HF model": v["perturb_s"],
        "pushing weights": v["push_s"],
        "decoding": v["decode_s"],
    }
    costs["the ES update"] = v["update_s"]
    top = max(costs, key=costs.get)
    goal = "meets" if ratio <= 0.5 else "misses"
    return (
        f"vLLM step time is {ratio:.2f}x the transformers step time (CPU time {cpu_ratio:.2f}x); this {goal} the "
        f"goal of at most 0.5x. In a vLLM step, {top} dominates ({costs[top]:.1f} s of {v['step_s']:.1f} s); "
        f"pushing weights costs {v['push_s']:.1f} s per step "
        f"({v['push_s'] / max(1, summary['population_size']):.2f} s per member), "
        f"decoding {v['decode_s']:.1f} s."
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2, help="measured steps per backend (after one warm-up)")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--no-write", action="store_true", help="print only; do not write results/")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:  # one backend, in this process; the result goes to stdout as the last line
        result = run_backend(args.child, json.loads(args.settings), args.steps)
        print("RESULT " + json.dumps(result), flush=True)
        return

    settings = quickstart_settings()
    report = dict(
        command="python benchmarks/vllm_vs_transformers.py " + " ".join(sys.argv[1:]),
        date=dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        machine=machine(),
        settings=settings,
        steps=args.steps,
        results={},
    )
    for backend in args.backends:  # one after the other, never concurrently
        cmd = [sys.executable, __file__, "--child", backend, "--settings", json.dumps(settings)]
        cmd += ["--steps", str(args.steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.stderr.write(proc.stdout[-5000:] + proc.stderr[-5000:])
            raise SystemExit(f"{backend} run failed (exit code {proc.returncode})")
        for line in proc.stdout.splitlines():
            if line.startswith(f"[{backend}]"):
                print(line, flush=True)
        report["results"][backend] = json.loads(lines[-1][len("RESULT ") :])

    if set(report["results"]) != set(BACKENDS):
        print(json.dumps(report, indent=2))
        return
    report["summary"] = {b: summarize(r) for b, r in report["results"].items()}
    report["summary"]["population_size"] = settings["population_size"]
    report["verdict"] = verdict(report["summary"])
    same = (
        report["results"]["vllm"]["final_weights_sum"]
        == report["results"]["transformers"]["final_weights_sum"]
    )
    report["same_final_weights_checksum"] = same
    markdown = to_markdown(report)
    markdown += (
        f"Final weights after {args.steps + 1} steps: checksums "
        f"{'identical' if same else 'differ (some completions differed between the backends)'}.\n"
    )
    print(markdown)
    if not args.no_write:
        out = REPO / "results"
        out.mkdir(parents=True, exist_ok=True)
        (out / "vllm_vs_transformers.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "vllm_vs_transformers.md").write_text(markdown)


if __name__ == "__main__":  # vLLM may spawn processes that import this file: keep work under the guard
    main()
