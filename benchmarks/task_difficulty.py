"""How hard is a task (default: synthetic GSM8K) for the embedded model? Pass rates per difficulty level.

Greedy generation with `transformers` (fp32, all prompts in one left-padded batch) on the synthetic test
split, scored with the task's reward functions (`gsm8k_accuracy_reward` / `gsm8k_format_reward` by default). Optionally also a few perturbed copies of
the model (θ + σ·ε, as an ES population would evaluate them) to tell problems the model always solves from
those it solves only sometimes ("near the boundary", where DART-ES's replay aims) and those it never solves.

    python benchmarks/task_difficulty.py                      # defaults below, ~10 min on 2 shared cores
    python benchmarks/task_difficulty.py --num-prompts 24 --members 0 --no-write   # quick look

Writes results/task_difficulty.json and results/task_difficulty.md. Tasks without a `level`
column (Countdown) are reported as one level, 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import zlib
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from trl_dart_es.benchmark.machine import utc_now  # noqa: E402
from trl_dart_es.embedded import load_model, load_tokenizer  # noqa: E402
from trl_dart_es.tasks import get_task, load_task_dataset  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def generate(model, tokenizer, prompts, max_new_tokens: int, batch_size: int) -> tuple[list[str], int]:
    """Greedy completions for conversational prompts; also returns the number of generated tokens."""
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    completions: list[str] = []
    generated = 0
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(texts[start : start + batch_size], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(
                **batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        new = out[:, batch["input_ids"].shape[1] :]
        generated += int((new != tokenizer.pad_token_id).sum())
        completions += tokenizer.batch_decode(new, skip_special_tokens=True)
    return completions, generated


def perturb_(model, seed: int, sigma: float) -> None:
    """θ += σ·ε with ε drawn per tensor from a generator seeded by (seed, parameter name)."""
    for name, param in model.named_parameters():
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        param.data.add_(torch.randn(param.shape, generator=gen, dtype=param.dtype), alpha=sigma)


def per_level(levels, values) -> dict[int, float]:
    groups: dict[int, list[float]] = defaultdict(list)
    for level, value in zip(levels, values, strict=True):
        groups[level].append(value)
    return {level: sum(v) / len(v) for level, v in sorted(groups.items())}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="embedded:smollm2-135m")
    parser.add_argument("--task", default="embedded:gsm8k")
    parser.add_argument("--num-prompts", type=int, default=72)
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic test split")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=72)
    parser.add_argument("--members", type=int, default=3, help="perturbed copies to evaluate (0: base only)")
    parser.add_argument("--sigma", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-write", action="store_true", help="print only, do not write results")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    dataset = load_task_dataset(args.task, "test", num_examples=args.num_prompts, seed=args.seed)
    accuracy_reward, format_reward = get_task(args.task).reward_funcs
    # Reward functions get the dataset columns as keyword arguments, the way TRL's trainers call them.
    columns = {c: dataset[c] for c in dataset.column_names if c != "prompt"}
    levels = dataset["level"] if "level" in dataset.column_names else [0] * len(dataset)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model).eval()
    load_avg = os.getloadavg()

    runs = []
    originals = {name: p.detach().clone() for name, p in model.named_parameters()} if args.members else {}
    for member in range(args.members + 1):  # member 0 is the unperturbed model
        if member:
            perturb_(model, seed=member, sigma=args.sigma)
        start = time.perf_counter()
        completions, n_tokens = generate(
            model, tokenizer, dataset["prompt"], args.max_new_tokens, args.batch_size
        )
        seconds = time.perf_counter() - start
        if member:  # exact restore: copy the saved values back
            for name, param in model.named_parameters():
                param.data.copy_(originals[name])
        accuracy = accuracy_reward(completions, **columns)
        fmt = format_reward(completions, **columns)
        runs.append({
            "member": member, "accuracy": sum(accuracy) / len(accuracy),
            "accuracy_per_level": per_level(levels, accuracy), "format_per_level": per_level(levels, fmt),
            "full_format_rate": sum(f == 1.0 for f in fmt) / len(fmt), "seconds": round(seconds, 1),
            "generated_tokens": n_tokens, "correct": accuracy, "completions": completions,
        })  # fmt: skip
        print(
            f"member {member}: accuracy {runs[-1]['accuracy']:.3f} per level "
            f"{ {k: round(v, 3) for k, v in runs[-1]['accuracy_per_level'].items()} } "
            f"({seconds:.0f} s, {n_tokens} tokens)",
            flush=True,
        )

    # Solve counts across the base model and its perturbed copies: the population view of DART-ES.
    solves = [sum(run["correct"][j] for run in runs) for j in range(len(dataset))]
    total = len(runs)
    classes = ["always" if s == total else "never" if s == 0 else "sometimes" for s in solves]
    by_level: dict[int, dict[str, int]] = defaultdict(lambda: {"always": 0, "sometimes": 0, "never": 0})
    for level, cls in zip(levels, classes, strict=True):
        by_level[level][cls] += 1

    result = {
        "command": "python benchmarks/task_difficulty.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "no_write" and v is not None),
        "date": utc_now(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, load average at start {load_avg[0]:.1f}",
        "settings": {k: v for k, v in vars(args).items() if k != "no_write"},
        "num_problems_per_level": {lvl: levels.count(lvl) for lvl in sorted(set(levels))},
        "greedy_base": {k: runs[0][k] for k in ("accuracy", "accuracy_per_level", "format_per_level", "full_format_rate")},
        "members": [
            {k: run[k] for k in ("member", "accuracy", "accuracy_per_level", "seconds", "generated_tokens")}
            for run in runs
        ],
        "solved_by_base_and_perturbed": {lvl: dict(v) for lvl, v in sorted(by_level.items())},
        "problems": [
            {"id": dataset["id"][j], "level": levels[j], **{c: columns[c][j] for c in ("answer",) if c in columns},
             "solved_by": [run["member"] for run in runs if run["correct"][j] == 1.0]}
            for j in range(len(dataset))
        ],
        # GSM8K rows show answer + question; other tasks show their prompt.
        "examples": [
            {"id": dataset["id"][j], "level": levels[j],
             **({c: columns[c][j] for c in ("answer", "question")} if "question" in columns else {"prompt": dataset["prompt"][j]}),
             "base_completion": runs[0]["completions"][j], "solved_by": solves[j]}
            for j in range(min(6, len(dataset)))
        ],
    }  # fmt: skip

    lines = [
        f"# {args.task} difficulty for {args.model}",
        "",
        f"`{result['command']}`, {result['date']}, {result['machine']}.",
        "",
        f"Greedy, fp32, `transformers` generate, {args.max_new_tokens} new tokens. Perturbed copies: "
        f'{args.members} (σ = {args.sigma}). "always/sometimes/never" count problems solved by all, some or none '
        f"of the {total} models (base + perturbed).",
        "",
        "| level | problems | greedy pass rate | full-format rate | always | sometimes | never |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    full_format = per_level(levels, [f == 1.0 for f in format_reward(runs[0]["completions"], **columns)])
    for lvl in sorted(by_level):
        c = by_level[lvl]
        lines.append(
            f"| {lvl} | {levels.count(lvl)} | {runs[0]['accuracy_per_level'][lvl]:.2f} | {full_format[lvl]:.2f} "
            f"| {c['always']} | {c['sometimes']} | {c['never']} |"
        )
    member_acc = ", ".join(f"{run['accuracy']:.3f}" for run in runs[1:]) or "none"
    lines += ["", f"Overall greedy pass rate {runs[0]['accuracy']:.3f}; perturbed copies: {member_acc}.", ""]
    markdown = "\n".join(lines)
    print(markdown)
    if not args.no_write:
        out = REPO / "results"
        out.mkdir(parents=True, exist_ok=True)
        (out / "task_difficulty.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "task_difficulty.md").write_text(markdown)


if __name__ == "__main__":
    main()
