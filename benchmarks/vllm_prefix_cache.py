"""What vLLM's prefix cache (`vllm_enable_prefix_caching=True`) buys a low-rank population on this CPU.

    python benchmarks/vllm_prefix_cache.py          # ~8 min on 2 CPU cores

One fresh process per (system prompt, cache) case starts the package's engine on the embedded model (fp32,
LoRA slots for the demo's 4 members, the cache on or off) and generates the demo's population through the
package's rollout: 4 rank-1 members (2 antithetic pairs) x 32 train prompts, greedy, up to 64 tokens, twice.
System prompts: the demo's ("answer", 26 tokens shared by every prompt, less than one 32-token block),
the same behind one sentence ("answer-math": 32 shared tokens, one whole block) and a longer one with an example
(83 shared tokens: two whole blocks). Writes results/vllm_prefix_cache.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from trl_dart_es.benchmark import machine_description
from trl_dart_es.tasks.gsm8k import PROMPT_STYLES

ROOT = Path(__file__).resolve().parent.parent
LONG = (
    "You are a careful math tutor. Read the word problem, work out the result in your head, and reply with one "
    "line only: #### followed by the final number. Example: a shop sells 3 boxes of 12 eggs, so the reply is "
    "#### 36. Give only the final answer, written as #### followed by the number. Do not explain."
)
# "answer-math" is the "answer" prompt behind one sentence: 32 shared tokens, exactly one whole block.
SYSTEMS = {"answer": None, "answer-math": PROMPT_STYLES["answer-math"], "long": LONG}


def measure(system: str, cache: bool, members: int, prompts: int, max_tokens: int, repeats: int) -> dict:
    """Runs in its own process: engine start, then `repeats` timed population generations."""
    import torch

    from trl_dart_es.embedded import load_model, load_tokenizer
    from trl_dart_es.lowrank import LowRankParameters, lora_carried_names
    from trl_dart_es.noise import Member
    from trl_dart_es.rollout import vllm as vllm_rollout
    from trl_dart_es.rollout.transformers import greedy_generation_config
    from trl_dart_es.rollout.vllm_lowrank import VLLMLowRankRollout
    from trl_dart_es.tasks.gsm8k import make_synthetic_gsm8k

    model = load_model("embedded:smollm2-135m", dtype=torch.float32).eval()
    tok = load_tokenizer("embedded:smollm2-135m")
    rows = make_synthetic_gsm8k(prompts, split="train", prompt_style="answer")["prompt"]
    text = SYSTEMS[system]
    rows = [[{**m, "content": text} if m["role"] == "system" and text else m for m in p] for p in rows]
    start = time.perf_counter()
    engine = vllm_rollout.start_engine(
        model, cpu_kvcache_space=1, max_model_len=1024, max_loras=members, max_lora_rank=1,
        enable_prefix_caching=cache,
    )  # fmt: skip
    result = {
        "system": system,
        "prefix_caching": cache,
        "start_s": time.perf_counter() - start,
        "generate_s": [],
    }
    params = LowRankParameters(model, 2e-3, rank=1, names=lora_carried_names(model))
    rollout = VLLMLowRankRollout(model, tok, greedy_generation_config(tok, max_tokens), params, engine)
    population = [Member(seed, sign) for seed in range(members // 2) for sign in (1, -1)]
    for _ in range(repeats):
        start = time.perf_counter()
        gens = rollout.generate_population(rows, population)
        result["generate_s"].append(time.perf_counter() - start)
    encoded = rollout._encode(rows)
    result["prompt_tokens"] = members * sum(len(r["prompt_token_ids"]) for r in encoded)
    result["shared_prefix_tokens"] = len(os.path.commonprefix([r["prompt_token_ids"] for r in encoded]))
    result["completion_tokens"] = sum(len(ids) for g in gens for ids in g.token_ids)
    result["completions"] = [ids for g in gens for ids in g.token_ids]
    vllm_rollout.shutdown_engine()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32, help="problems per member (the demo's 32)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", default=str(ROOT / "results" / "vllm_prefix_cache"))
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # SYSTEM on|off, in this process
    args = parser.parse_args()
    if args.child:
        system, cache = args.child[0], args.child[1] == "on"
        res = measure(system, cache, args.members, args.prompts, args.max_tokens, args.repeats)
        print("RESULT " + json.dumps(res))
        return

    rows = []
    for system in args.systems:
        for cache in ("off", "on"):  # a fresh process each: one engine per process
            cmd = [sys.executable, __file__, "--child", system, cache, "--members", str(args.members)]
            cmd += [
                "--prompts",
                str(args.prompts),
                "--max-tokens",
                str(args.max_tokens),
                "--repeats",
                str(args.repeats),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if out.returncode != 0 or not lines:
                raise RuntimeError(
                    f"{system} / cache {cache} failed (rc {out.returncode}):\n{out.stderr[-3000:]}"
                )
            rows.append(json.loads(lines[-1].removeprefix("RESULT ")))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "completions"}))
    for row in rows:  # same completions with and without the cache, per system prompt
        off = next(r for r in rows if r["system"] == row["system"] and not r["prefix_caching"])
        row["identical_to_off"] = sum(
            a == b for a, b in zip(row["completions"], off["completions"], strict=True)
        )
        row["rollouts"] = len(row["completions"])
    for row in rows:
        del row["completions"]
    meta = {
        "machine": machine_description(),
        "command": "python " + shlex.join(["benchmarks/vllm_prefix_cache.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    out = Path(args.output)
    out.with_suffix(".json").write_text(
        json.dumps({**meta, "systems": SYSTEMS, "rows": rows}, indent=1) + "\n"
    )
    lines = [
        "# vLLM prefix caching for a low-rank population",
        "",
        f"- {args.members} rank-1 members (LoRA adapters of one engine) x {args.prompts} train prompts, greedy, "
        f"up to {args.max_tokens} tokens, fp32; {meta['date']}; machine: {meta['machine']}.",
        f"- Command: `{meta['command']}`.",
        "- `long` system prompt: " + repr(LONG) + ".",
        "",
        "| system prompt | shared prefix tokens | prompt tokens | prefix cache | generate (s), each run | "
        "vs off | completions identical to off |",
        "| --- | ---: | ---: | --- | --- | ---: | ---: |",
    ]
    for r in rows:
        off = next(x for x in rows if x["system"] == r["system"] and not x["prefix_caching"])
        ratio = min(r["generate_s"]) / min(off["generate_s"])
        runs = " ".join(f"{s:.1f}" for s in r["generate_s"])
        lines.append(
            f"| {r['system']} | {r['shared_prefix_tokens']} | {r['prompt_tokens']} | "
            f"{'on' if r['prefix_caching'] else 'off'} | {runs} | {ratio:.2f}x | "
            f"{r['identical_to_off']}/{r['rollouts']} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
