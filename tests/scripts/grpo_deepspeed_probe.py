"""Runs a GRPO recipe (recipes/grpo_gsm8k.py or recipes/grpo_lora_gsm8k.py) unchanged, with a callback that
records what the launch really did; used by tests/test_deepspeed.py under `accelerate launch` with the repo's
DeepSpeed configs.

    accelerate launch --config_file recipes/accelerate_configs/deepspeed_zero3_cpu.yaml \
        tests/scripts/grpo_deepspeed_probe.py --recipe grpo_gsm8k --probe-out DIR -- <recipe arguments>

Every process writes `DIR/rank<r>.json`: world sizes (torch.distributed and Accelerate), the class of the
wrapped model and of its optimizer, the engine's ZeRO stage, for ZeRO-3 the local and full size of every
parameter, and whether the trainable weights changed between the start and the end of training (compared on
the full, gathered tensors).
"""

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
sys.path.insert(0, str(RECIPES))

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer, ModelConfig, TrlParser  # noqa: E402

from trl_dart_es.tasks.arguments import TaskArguments  # noqa: E402


def _trainable_snapshot(engine) -> dict[str, torch.Tensor]:
    """Full copies of the trainable parameters (gathered from every rank under ZeRO-3; a collective)."""
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            return {n: p.detach().clone() for n, p in named}
    return {n: p.detach().clone() for n, p in named}


def probe_trainer_class(out: Path):
    class Probe(TrainerCallback):
        def __init__(self, trainer):
            self.trainer, self.info, self.before = trainer, {}, {}

        def on_train_begin(self, args, state, control, **kwargs):
            import torch.distributed as dist
            from deepspeed import DeepSpeedEngine

            engine = self.trainer.model_wrapped
            info = self.info
            info["rank"] = dist.get_rank()
            info["torch_world_size"] = dist.get_world_size()
            info["accelerate_num_processes"] = self.trainer.accelerator.num_processes
            info["engine_class"] = type(engine).__name__
            info["is_deepspeed_engine"] = isinstance(engine, DeepSpeedEngine)
            if not info["is_deepspeed_engine"]:
                return
            info["zero_stage"] = engine.zero_optimization_stage()
            info["optimizer_class"] = type(engine.optimizer).__name__
            if info["zero_stage"] == 3:
                info["partitions"] = {
                    n: [p.ds_tensor.numel(), p.ds_numel, p.numel()]
                    for n, p in engine.module.named_parameters()
                }
            self.before = _trainable_snapshot(engine)

        def on_train_end(self, args, state, control, **kwargs):
            engine = self.trainer.model_wrapped
            if self.before:
                after = _trainable_snapshot(engine)
                diffs = {n: (after[n] - self.before[n]).abs().max().item() for n in self.before}
                self.info["trainable_params"] = len(diffs)
                self.info["max_abs_change"] = diffs
            self.info["global_step"] = state.global_step
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank{self.info.get('rank', 0)}.json").write_text(json.dumps(self.info))

    class ProbeGRPOTrainer(GRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.add_callback(Probe(self))

    return ProbeGRPOTrainer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recipe", choices=["grpo_gsm8k", "grpo_lora_gsm8k"], required=True)
    p.add_argument("--probe-out", required=True)
    cli, recipe_argv = p.parse_known_args()
    recipe_argv = [a for a in recipe_argv if a != "--"]
    grpo = importlib.import_module("grpo_gsm8k")
    grpo.GRPOTrainer = probe_trainer_class(
        Path(cli.probe_out)
    )  # the recipe builds its trainer from this name
    recipe = importlib.import_module(cli.recipe)
    parser = TrlParser((TaskArguments, GRPOConfig, ModelConfig))
    recipe.main(*parser.parse_args_and_config(grpo.cpu_launch_args(recipe_argv)))


if __name__ == "__main__":
    main()
