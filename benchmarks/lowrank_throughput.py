"""Throughput of low-rank population batching (EGGROLL) against plain batched inference and full-rank ES.

On the embedded SmolLM2-135M with the quickstart shape (N members x B prompts, `max_completion_length` from
recipes/configs/quickstart_fullrank.yaml), measures in one run:

(a) plain batched inference: the unperturbed model on the same N*B rows, one `generate` call;
(b) low-rank population generation: `LowRankRollout.generate_population`, one `generate` over N*B rows with
    each member's rank-r perturbation added by hooks (what an ES step does);
(c) full-rank per-member generation: `TransformersRollout.generate_population`, perturb in place and one
    `generate` of B rows per member (measured on the first `--full-rank-members` members: throughput per
    member does not depend on N, and the full population would take minutes).

Every row decodes exactly `max_new_tokens` tokens (EOS is suppressed with `min_new_tokens`), so the three
numbers count the same work. Run once, under the heavy-run lock, on an otherwise idle machine if possible:

    flock /tmp/heavy.lock .venv/bin/python benchmarks/lowrank_throughput.py
    # writes results/lowrank_throughput.{json,md}; ~3-5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import time
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from trl_dart_es.embedded import resolve_model_path
from trl_dart_es.lowrank import LowRankParameters
from trl_dart_es.noise import population
from trl_dart_es.perturb import EvolvedParameters
from trl_dart_es.rollout.lowrank import LowRankRollout
from trl_dart_es.rollout.prompts import render_prompts
from trl_dart_es.rollout.transformers import TransformersRollout, greedy_generation_config
from trl_dart_es.tasks import load_task_dataset

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "configs" / "quickstart_fullrank.yaml"


def quickstart_shape() -> dict:
    shape = dict(population_size=8, per_device_train_batch_size=16, max_completion_length=64, sigma=2e-3)
    if QUICKSTART.exists():
        cfg = yaml.safe_load(QUICKSTART.read_text())
        shape.update({k: cfg[k] for k in shape if k in cfg})
    return shape


def timed(fn):
    """Result, wall seconds, and this process's CPU seconds (less sensitive to other jobs on shared cores)."""
    start, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - start, time.process_time() - cpu


def render_markdown(r: dict) -> str:
    """The Markdown report of one result (also: ``--render-only`` re-renders the saved JSON)."""
    m, s, fr = r["machine"], r["shape"], r["fullrank_per_member"]
    a, b = r["plain_batched"], r["lowrank_population"]
    n, rows, t, k = s["population_size"], s["rows"], s["max_new_tokens"], s["full_rank_members_measured"]
    load = m["load_average_before_after"]
    return f"""# Low-rank population batching: throughput

Measured {r["date"]} by `benchmarks/lowrank_throughput.py` on this machine: {m["cpu_count"]} CPU cores,
torch {m["torch"]} with {m["torch_threads"]} threads. 1-minute load average {load[0]:.2f} before and
{load[3]:.2f} after: other jobs may have shared the cores; CPU seconds are less sensitive to that.

Model: {r["model"]}. Shape: N = {n} members x B = {s["prompts_per_step"]} GSM8K-style prompts (mean prompt
length {s["mean_prompt_tokens"]:.0f} tokens) = {rows} rows, {t} new tokens per row, greedy, rank r = {s["rank"]},
sigma = {s["sigma"]}. EOS is suppressed, so every mode decodes the same number of tokens. Times include the
prompt prefill, as an ES step does.

| mode | generate calls | wall s | CPU s | generated tokens | tokens/s (wall) |
| --- | --- | --- | --- | --- | --- |
| (a) plain batched inference, unperturbed, {rows} rows | 1 | {a["seconds"]:.1f} | {a["cpu_seconds"]:.1f} | {a["tokens"]} | {a["tokens_per_s"]:.1f} |
| (b) low-rank population (ES step), {rows} rows | 1 | {b["seconds"]:.1f} | {b["cpu_seconds"]:.1f} | {b["tokens"]} | {b["tokens_per_s"]:.1f} |
| (c) full rank: perturb + generate per member, {s["prompts_per_step"]} rows each | {k} (of {n}) | {fr["seconds"]:.1f} | {fr["cpu_seconds"]:.1f} | {fr["tokens"]} | {fr["tokens_per_s"]:.1f} |

- **(b)/(a) = {r["lowrank_over_plain"]:.1%}** of plain batched inference throughput in wall time
  ({r["lowrank_over_plain_cpu_time"]:.1%} in CPU time). Goal: at least 80%; EGGROLL reports ~91% on GPUs.
- (b)/(c) = {r["lowrank_over_fullrank"]:.2f}x the full-rank throughput. Full rank would need about
  {fr["projected_seconds_for_population"]:.0f} s for the whole population ({fr["seconds_per_member"]:.1f} s per member,
  perturbation included), against {b["seconds"]:.0f} s batched.
- Low-rank update for the N = {n} members (one matmul per matrix into the fp32 master): {r["lowrank_update_seconds"]:.2f} s.
"""


def main() -> None:
    shape = quickstart_shape()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--population-size", type=int, default=shape["population_size"])
    parser.add_argument("--batch-size", type=int, default=shape["per_device_train_batch_size"])
    parser.add_argument("--max-new-tokens", type=int, default=shape["max_completion_length"])
    parser.add_argument("--sigma", type=float, default=shape["sigma"])
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--full-rank-members", type=int, default=2)
    parser.add_argument("--output-dir", default=str(ROOT / "results"))
    parser.add_argument("--no-write", action="store_true", help="print only (smoke runs)")
    parser.add_argument("--render-only", action="store_true", help="re-render the .md from the saved .json")
    args = parser.parse_args()
    if args.render_only:
        out = Path(args.output_dir)
        result = json.loads((out / "lowrank_throughput.json").read_text())
        (out / "lowrank_throughput.md").write_text(render_markdown(result))
        return
    n, b, t = args.population_size, args.batch_size, args.max_new_tokens
    k = min(args.full_rank_members, n)
    torch.manual_seed(0)
    load_before = os.getloadavg()

    path = resolve_model_path("embedded:smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    prompts = load_task_dataset("embedded:gsm8k", "train")["prompt"][:b]
    # min_new_tokens: the same work in every mode, no row stops early
    config = greedy_generation_config(tokenizer, t, min_new_tokens=t)
    members = population(1234, n)
    lowrank = LowRankRollout(model, tokenizer, config, LowRankParameters(model, args.sigma, rank=args.rank))
    fullrank = TransformersRollout(model, tokenizer, config, EvolvedParameters(model, args.sigma))
    prompt_tokens = [
        len(ids)
        for ids in tokenizer(render_prompts(prompts, tokenizer), add_special_tokens=False)["input_ids"]
    ]

    # Warm-up (first-call allocations, thread pools) on a short generation.
    warm = GenerationConfig(**{**config.to_dict(), "max_new_tokens": 2, "min_new_tokens": 2})
    LowRankRollout(model, tokenizer, warm, lowrank.params).generate_population(prompts[:2], members[:2])

    plain, t_plain, c_plain = timed(lambda: lowrank.generate(prompts * n))
    pop, t_pop, c_pop = timed(lambda: lowrank.generate_population(prompts, members))
    full, t_full, c_full = timed(lambda: fullrank.generate_population(prompts, members[:k]))
    _, t_update_lr, _ = timed(
        lambda: lowrank.params.update(members, [float(i) - n / 2 for i in range(n)], 1e-9)
    )

    tokens_plain = plain.num_tokens
    tokens_pop = sum(g.num_tokens for g in pop)
    tokens_full = sum(g.num_tokens for g in full)
    result = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_before_after": [*load_before, *os.getloadavg()],
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "model": "embedded:smollm2-135m (fp32)",
        "shape": {
            "population_size": n,
            "prompts_per_step": b,
            "rows": n * b,
            "max_new_tokens": t,
            "mean_prompt_tokens": sum(prompt_tokens) / len(prompt_tokens),
            "rank": args.rank,
            "sigma": args.sigma,
            "full_rank_members_measured": k,
        },
        "plain_batched": {
            "seconds": t_plain,
            "cpu_seconds": c_plain,
            "tokens": tokens_plain,
            "tokens_per_s": tokens_plain / t_plain,
        },
        "lowrank_population": {
            "seconds": t_pop,
            "cpu_seconds": c_pop,
            "tokens": tokens_pop,
            "tokens_per_s": tokens_pop / t_pop,
        },
        "fullrank_per_member": {
            "seconds": t_full,
            "cpu_seconds": c_full,
            "tokens": tokens_full,
            "tokens_per_s": tokens_full / t_full,
            "seconds_per_member": t_full / k,
            "projected_seconds_for_population": t_full / k * n,
        },
        "lowrank_update_seconds": t_update_lr,
        "lowrank_over_plain": (tokens_pop / t_pop) / (tokens_plain / t_plain),
        "lowrank_over_fullrank": (tokens_pop / t_pop) / (tokens_full / t_full),
        "lowrank_over_plain_cpu_time": (tokens_pop / c_pop) / (tokens_plain / c_plain),
    }
    print(json.dumps(result, indent=2))
    if args.no_write:
        return
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lowrank_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "lowrank_throughput.md").write_text(render_markdown(result))
    print(f"wrote {out / 'lowrank_throughput.json'} and .md")


if __name__ == "__main__":
    main()
