"""A few DART-ES steps on a tiny model, run alone or under `accelerate launch`; used by tests/test_distributed.py.

Every process writes `<out>/rank<r>.json` (world size, its members, DART state) and
`<out>/rank<r>.safetensors` (its final weights), so the test can check that the run really had the
expected number of processes and that every process ends with the same weights as a one-process run.

    python tests/scripts/dist_train.py --tokenizer DIR --out DIR
    accelerate launch --multi_gpu --num_processes 2 tests/scripts/dist_train.py --tokenizer DIR --out DIR

`--fail-rank R --fail-step S --fail-mode exit|hang|kill` makes rank R die (`os._exit(0)`, no traceback and a
"successful" exit code, the worst case for a launcher), hang, or wait to be killed inside its reward function at
step S. `kill` writes the process's pid to `<out>/kill_rank<R>.pid` first: the test then SIGKILLs it from outside,
as the kernel or an operator would. `save-exit` makes rank R die as it starts to save the checkpoint of step S.

`--save-steps K` writes a checkpoint every K steps, `--resume DIR` resumes from a checkpoint.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest.make_tiny_llama
from conftest import make_tiny_llama  # noqa: E402

from trl_dart_es import DartESConfig, DartESTrainer  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--population", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--members-per-group", type=int, default=None, help="the grouped population layout")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max-completion-length", type=int, default=6)
    p.add_argument("--ddp-timeout", type=int, default=1800)
    p.add_argument("--log-completions", action="store_true", help="log_completions=True (parquet per step)")
    p.add_argument("--no-use-cpu", action="store_true", help="leave use_cpu=False (mis-launch on CPU)")
    p.add_argument("--fail-rank", type=int, default=None)
    p.add_argument("--fail-step", type=int, default=2)
    p.add_argument("--fail-mode", choices=["exit", "hang", "kill", "save-exit"], default="exit")
    p.add_argument("--save-steps", type=int, default=None, help="a checkpoint every K steps (default: none)")
    p.add_argument("--resume", default=None, help="a checkpoint to resume from")
    p.add_argument("--report-to", default="none")
    p.add_argument(
        "--vllm-lowrank",
        action="store_true",
        help="use_vllm=True, perturbation='lowrank' on a tiny model vLLM's CPU attention runs (head size 64)",
    )
    return p.parse_args()


def main() -> None:
    cli = parse_args()
    rank = int(os.environ.get("RANK", 0))
    tokenizer = AutoTokenizer.from_pretrained(cli.tokenizer, padding_side="left")
    hidden = 128 if cli.vllm_lowrank else 16
    model = make_tiny_llama(vocab_size=len(tokenizer), hidden=hidden, layers=1)
    for cfg in (model.config, model.generation_config):
        cfg.pad_token_id = tokenizer.pad_token_id
        cfg.eos_token_id = tokenizer.eos_token_id

    n = 12
    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {i} + {i + 1}?"}] for i in range(n)],
            "id": [f"p{i}" for i in range(n)],
        }
    )

    def parity_reward(completion_ids, trainer_state=None, **kwargs):
        """Primary 0/1 reward: solved when the first generated token id is even."""
        if (
            cli.fail_rank == rank
            and cli.fail_mode != "save-exit"
            and trainer_state is not None
            and trainer_state.global_step + 1 == cli.fail_step
        ):
            print(f"[rank {rank}] failing ({cli.fail_mode}) at step {cli.fail_step}", flush=True)
            if cli.fail_mode == "exit":
                os._exit(0)
            if cli.fail_mode == "kill":  # tell the test whom to kill, atomically (it polls for the file)
                pid_file = Path(cli.out) / f"kill_rank{rank}.pid"
                pid_file.parent.mkdir(parents=True, exist_ok=True)
                pid_file.with_suffix(".tmp").write_text(str(os.getpid()))
                pid_file.with_suffix(".tmp").rename(pid_file)
            time.sleep(3600)
        return [float(ids[0] % 2 == 0) if ids else 0.0 for ids in completion_ids]

    def length_reward(completions, **kwargs):
        return [len(c[0]["content"]) / 100.0 for c in completions]

    args = DartESConfig(
        output_dir=str(Path(cli.out) / "trainer"),
        population_size=cli.population,
        per_device_train_batch_size=cli.batch,
        max_completion_length=cli.max_completion_length,
        sigma=0.05,
        learning_rate=0.05,
        max_steps=cli.steps,
        use_cpu=not cli.no_use_cpu,  # without it Accelerate on a GPU-less machine sees one process per rank
        ddp_timeout=cli.ddp_timeout,
        report_to=cli.report_to,
        seed=0,
        disable_tqdm=True,
        logging_steps=1,
        log_completions=cli.log_completions,
        num_completions_to_print=0,
        **(
            dict(save_strategy="steps", save_steps=cli.save_steps)
            if cli.save_steps
            else dict(save_strategy="no")
        ),
        **(
            dict(population_layout="grouped", members_per_group=cli.members_per_group)
            if cli.members_per_group
            else {}
        ),
        **(
            dict(
                use_vllm=True,
                perturbation="lowrank",
                perturbation_rank=2,
                vllm_cpu_kvcache_space=1,
                vllm_max_model_length=256,
            )
            if cli.vllm_lowrank
            else {}
        ),
    )
    trainer = DartESTrainer(
        model=model,
        reward_funcs=[parity_reward, length_reward],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    acc = trainer.accelerator
    world = acc.num_processes
    torch_world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    assert world == torch_world == int(os.environ.get("WORLD_SIZE", 1)), (world, torch_world)

    class Record(TrainerCallback):
        def __init__(self):
            self.metrics = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.metrics.append(dict(logs or {}))

    if cli.fail_mode == "save-exit" and cli.fail_rank == rank:
        save_checkpoint = trainer._save_checkpoint

        def save_or_die(*args, **kwargs):
            if trainer.state.global_step == cli.fail_step:
                print(f"[rank {rank}] failing (save-exit) at the save of step {cli.fail_step}", flush=True)
                os._exit(0)
            return save_checkpoint(*args, **kwargs)

        trainer._save_checkpoint = save_or_die

    record = Record()
    trainer.add_callback(record)
    trainer.train(resume_from_checkpoint=cli.resume)

    out = Path(cli.out)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().contiguous() for k, v in trainer.model.state_dict().items()}
    save_file(weights, str(out / f"rank{acc.process_index}.safetensors"))
    info = {
        "rank": acc.process_index,
        "world_size": world,
        "torch_world_size": torch_world,
        "local_members": trainer._local_members(cli.population),
        "local_rank": acc.local_process_index,
        "machine_rank": int(os.environ.get("GROUP_RANK", 0)),
        "is_main_process": acc.is_main_process,
        "is_local_main_process": acc.is_local_main_process,
        "global_step": trainer.state.global_step,
        "model_wrapped": type(trainer.model_wrapped).__name__,
        "rollout": type(trainer.rollout).__name__,
        "dart_state": trainer.strategy.state_dict(),
        "logs": record.metrics,
    }
    (out / f"rank{acc.process_index}.json").write_text(json.dumps(info))


if __name__ == "__main__":
    main()
