"""What the task's prompt asks for, and how long completions must be: the untrained embedded model, greedy.

    python benchmarks/prompt_probe.py                 # ~5 min on 2 CPU cores (vLLM if installed)

For each system prompt in `PROMPTS`, one greedy generation of up to `--max-tokens` tokens per held-out
prompt. Greedy decoding is prefix-consistent, so cutting each completion at L tokens gives exactly the
completion that `max_completion_length=L` would produce: one generation measures every length. Per prompt
and length: accuracy, format reward, the fraction of completions that hit the limit, and accuracy per
difficulty level. Per prompt style also: its mean length in tokens (chat template included) and the
seconds its one generation took, side by side in one run (on this CPU a prompt token costs about as much
compute as a generated one, so a shorter prompt is a faster step). Writes results/prompt_probe.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from trl_dart_es.benchmark import machine_description
from trl_dart_es.rewards import gsm8k_accuracy_reward, gsm8k_format_reward
from trl_dart_es.rollout.prompts import render_prompts
from trl_dart_es.tasks.gsm8k import GSM8K_SYSTEM_PROMPT, PROMPT_STYLES, make_synthetic_gsm8k

ROOT = Path(__file__).resolve().parent.parent
LENGTHS = (16, 24, 32, 40, 48, 64, 96)


def generate(prompts: list[list[dict]], max_tokens: int, model_dir: str) -> list[list[int]]:
    """Greedy token ids per prompt, with vLLM when it is installed, else transformers."""
    try:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM, SamplingParams
    except ImportError:
        LLM = None
    if LLM is not None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        llm = LLM(
            model=model_dir,
            dtype="float32",
            max_model_len=1024,
            enforce_eager=True,
            gpu_memory_utilization=0.3,
        )
        # A final assistant message is continued, as TRL's chat helper does.
        prefill = prompts[0][-1]["role"] == "assistant"
        outs = llm.chat(
            prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=True,
            add_generation_prompt=not prefill, continue_final_message=prefill,
        )  # fmt: skip
        return [list(o.outputs[0].token_ids) for o in outs]
    import torch

    from trl_dart_es.embedded import load_model, load_tokenizer

    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    tok.padding_side = "left"
    ids = []
    for start in range(0, len(prompts), 64):
        texts = render_prompts(prompts[start : start + 64], tok)
        batch = tok(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(
                **batch, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.pad_token_id
            )
        for row in out[:, batch["input_ids"].shape[1] :]:
            row = row.tolist()
            ids.append(row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256, help="held-out prompts")
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=list(LENGTHS), help="completion limits to score"
    )
    parser.add_argument("--styles", nargs="+", default=list(PROMPT_STYLES))
    parser.add_argument(
        "--extra-style", action="append", default=[], metavar="NAME=TEXT",
        help="a system prompt to try besides the package's styles (repeatable); it is added to --styles",
    )  # fmt: skip
    parser.add_argument("--output", default=str(ROOT / "results" / "prompt_probe"))
    args = parser.parse_args()
    for spec in args.extra_style:  # registered for this run only: the package's styles are unchanged
        name, sep, text = spec.partition("=")
        if not sep or not name or not text or name in PROMPT_STYLES:
            parser.error(f"--extra-style wants a new NAME=TEXT, got {spec!r}")
        PROMPT_STYLES[name] = text
        args.styles.append(name)

    from trl_dart_es.embedded import load_tokenizer, resolve_model_path

    model_dir = resolve_model_path("embedded:smollm2-135m")
    tok = load_tokenizer(model_dir)
    results = []
    for style in args.styles:
        data = make_synthetic_gsm8k(args.prompts, split="test", prompt_style=style)
        prompt_tokens = float(
            np.mean(
                [
                    len(tok(t, add_special_tokens=False)["input_ids"])
                    for t in render_prompts(list(data["prompt"]), tok)
                ]
            )
        )
        start = time.perf_counter()
        token_ids = generate(list(data["prompt"]), max(args.lengths), model_dir)
        seconds = time.perf_counter() - start
        levels = np.asarray(data["level"])
        for length in args.lengths:
            cut = [ids[:length] for ids in token_ids]
            texts = [tok.decode(ids, skip_special_tokens=True) for ids in cut]
            hit = np.asarray([len(ids) >= length and tok.eos_token_id not in ids for ids in cut])
            acc = np.asarray(gsm8k_accuracy_reward(texts, answer=list(data["answer"])), dtype=float)
            fmt = np.asarray(gsm8k_format_reward(texts), dtype=float)
            row = {
                "style": style, "length": length, "accuracy": acc.mean(), "format": fmt.mean(),
                "hit_limit": hit.mean(), "mean_tokens": float(np.mean([len(c) for c in cut])),
                "prompt_tokens": prompt_tokens, "generate_s": seconds, "generate_tokens": max(args.lengths),
            }  # fmt: skip
            row.update({f"accuracy_level{lv}": float(acc[levels == lv].mean()) for lv in sorted(set(levels))})
            results.append(row)
            print(json.dumps(row))
    out = Path(args.output)
    meta = {
        "machine": machine_description(),
        "prompts": args.prompts,
        "command": "python " + shlex.join(["benchmarks/prompt_probe.py", *sys.argv[1:]]),
    }
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": results}, indent=1) + "\n")
    lines = [
        "# Prompt and completion-length probe (untrained embedded model, greedy)",
        "",
        f"- {args.prompts} held-out prompts of `embedded:gsm8k` (test split); machine: {meta['machine']}.",
        f"- Command: `{meta['command']}`.",
        "",
        "| prompt style | max tokens | accuracy | level 1 | level 2 | level 3 | format reward | hit limit | mean tokens | prompt tokens |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r['style']} | {r['length']} | {r['accuracy']:.1%} | {r.get('accuracy_level1', float('nan')):.1%} | "
            f"{r.get('accuracy_level2', float('nan')):.1%} | {r.get('accuracy_level3', float('nan')):.1%} | "
            f"{r['format']:.2f} | {r['hit_limit']:.0%} | {r['mean_tokens']:.1f} | {r['prompt_tokens']:.1f} |"
        )
    timed = {r["style"]: r for r in results}.values()  # one generation per style
    lines += [
        "",
        f"Seconds of one greedy generation of up to {max(args.lengths)} tokens per prompt, per style:",
        "",
    ]
    lines += [
        f"- {r['style']}: {r['generate_s']:.1f} s ({r['prompt_tokens']:.1f} prompt tokens)" for r in timed
    ]
    lines += ["", f"- Default system prompt (`steps`): {GSM8K_SYSTEM_PROMPT!r}"]
    lines += [
        f"- Extra style `{n}`: {PROMPT_STYLES[n]!r}" for n in (s.partition("=")[0] for s in args.extra_style)
    ]
    lines += [""]
    out.with_suffix(".md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
