"""`DartESTrainer`: DART-ES fine-tuning with the constructor and conventions of TRL's `GRPOTrainer`.

The ES algorithm itself lives in `trl_dart_es.strategy` (ask/tell), `perturb` and `noise`; this file is the
plumbing that connects it to `transformers.Trainer`: state, callbacks, logging, checkpoints, evaluation.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import textwrap
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from datasets import Dataset, IterableDataset
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import is_peft_available, logging
from trl.trainer.base_trainer import _BaseTrainer

from ..distributed import check_distributed_setup, gather_object_with_timeout
from ..embedded import resolve_model_path
from ..fitness import solved_matrix
from ..perturb import EvolvedParameters
from ..rollout import build as build_rollout
from ..rollout.base import check_population
from ..rollout.prompts import as_completions
from ..scoring import ACCURACY_GROUPS, RewardScorer, held_out_metrics
from ..strategy import DartES
from .completions import frac_reward_zero_std, log_completions, record_step_completions
from .dart_es_config import DartESConfig
from .transaction import (
    REFUSED_ON_RESUME,
    WARNED_ON_RESUME,
    StepSnapshot,
    check_resume_settings,
    held_interrupt,
    trajectory_settings,
)

if is_peft_available():
    from peft import PeftConfig, get_peft_model
    from peft import PeftModel as _PeftModel
else:  # pragma: no cover
    PeftConfig = _PeftModel = None

logger = logging.get_logger(__name__)

DART_STATE_NAME = "dart_es_state.json"
MASTER_WEIGHTS_NAME = "dart_es_master.safetensors"
VELOCITY_NAME = "dart_es_velocity.safetensors"  # the running update, with `momentum`
ID_COLUMN = "id"


def _disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def strided_to_dataset_order(values: np.ndarray, world: int) -> np.ndarray:
    """`values` of a dataset's rows gathered rank by rank, rank r holding rows r, r + world, ...: in row order."""
    order = np.concatenate([np.arange(r, len(values), world) for r in range(world)]).astype(int)
    out = np.empty_like(values)
    out[order] = values
    return out


class DartESTrainer(_BaseTrainer):
    """Fine-tunes a causal LM with DART-ES: evolution strategies with difficulty-aware reweighting and
    targeted replay (arXiv:2610.06993). Same arguments as TRL's `GRPOTrainer`.

    Args:
        model: a hub id, a local path, an embedded name such as `"embedded:smollm2-135m"`, a
            `PreTrainedModel` or a `PeftModel`.
        reward_funcs: a callable, a sequence-classification model id or model, or a list of these. Called as
            GRPO calls them. The function at `args.primary_reward_index` defines "solved".
        args: a `DartESConfig`.
        train_dataset: a `datasets.Dataset` with a `prompt` column (standard or conversational). An `id`
            column gives problems stable identities for the difficulty state; the row index is used otherwise.
        eval_dataset: evaluated greedily on the unperturbed model when `eval_strategy` says so.
        processing_class: the tokenizer; loaded from the model when omitted.
        reward_processing_classes: tokenizers of reward models, as in GRPO.
        callbacks: `transformers.TrainerCallback`s.
        optimizers: must be `(None, None)`: ES keeps no optimizer state.
        peft_config: wraps the model with PEFT; ES then perturbs and updates only the adapter.
    """

    _tag_names = ["trl", "dart-es", "evolution-strategies"]
    _name = "DART-ES"
    _paper = {
        "title": "DART-ES: Difficulty-Aware Reweighting and Targeted Replay for Fine-Tuning LLMs with "
        "Evolution Strategies",
        "id": "2610.06993",
        # docstyle-ignore
        "citation": textwrap.dedent("""\
            @article{sun2026dartes,
                title        = {{DART-ES: Difficulty-Aware Reweighting and Targeted Replay for Fine-Tuning LLMs with Evolution Strategies}},
                author       = {Sun and Wang and Dang and Dai and Ye},
                year         = 2026,
                eprint       = {arXiv:2610.06993},
            }
            @article{qiu2025es,
                title        = {{Evolution Strategies at Scale: LLM Fine-Tuning Beyond Reinforcement Learning}},
                author       = {Qiu and others},
                year         = 2025,
                eprint       = {arXiv:2509.24372},
            }"""),
    }

    def __init__(
        self,
        model: str | PreTrainedModel | Any,
        reward_funcs: Callable | str | Sequence[Callable | str] | None = None,
        args: DartESConfig | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | dict[str, Dataset] | None = None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple = (None, None),
        peft_config: PeftConfig | None = None,
        **unsupported: Any,
    ):
        if unsupported:
            raise TypeError(
                f"DartESTrainer does not support {sorted(unsupported)}: ES evaluates a population of weight "
                "perturbations and has no tools, rollout functions or quantized training."
            )
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = DartESConfig(f"{str(name).rstrip('/').split('/')[-1]}-DART-ES")
        if not isinstance(args, DartESConfig):
            raise TypeError(f"args must be a DartESConfig, got {type(args).__name__}")
        check_distributed_setup(args)  # before loading anything: DeepSpeed/FSDP, a mis-launched CPU run
        if optimizers is not None and any(o is not None for o in optimizers):
            raise ValueError(
                "DartESTrainer got `optimizers`, but evolution strategies use no optimizer or scheduler object: the "
                "update is θ ← θ + (α/N) Σ z_n ε_n. Set `learning_rate` and `lr_scheduler_type` in DartESConfig."
            )
        if train_dataset is None:
            raise ValueError("train_dataset is required")
        if isinstance(train_dataset, IterableDataset):
            raise ValueError(
                "DartESTrainer needs a map-style `datasets.Dataset`: problems are revisited by id"
            )
        if "prompt" not in train_dataset.column_names:
            raise ValueError(
                f"train_dataset has no 'prompt' column (columns: {train_dataset.column_names}); "
                "DART-ES uses TRL's prompt-only formats"
            )

        # Model, as GRPO loads it (an embedded name is converted once and cached as a normal folder).
        if isinstance(model, str):
            init_kwargs = dict(args.model_init_kwargs or {})
            init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
            model_path = resolve_model_path(model)
            model = AutoModelForCausalLM.from_pretrained(model_path, **init_kwargs)
        else:
            model_path = getattr(model.config, "_name_or_path", None)
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(
                model_path, trust_remote_code=args.trust_remote_code, padding_side="left"
            )
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        if peft_config is not None:
            if _PeftModel is not None and isinstance(model, _PeftModel):
                raise ValueError("pass either a PeftModel or a peft_config, not both")
            model = get_peft_model(model, peft_config)
        if args.disable_dropout:
            _disable_dropout(model)
        model.eval()
        model.config.pad_token_id = processing_class.pad_token_id
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if processing_class.eos_token_id not in eos:
            eos = [processing_class.eos_token_id, *eos]
        self.eos_token_ids = eos

        # Problems need stable ids: the difficulty state follows them across the whole run.
        self._train_rows = train_dataset
        ids = [
            str(i)
            for i in (
                train_dataset[ID_COLUMN]
                if ID_COLUMN in train_dataset.column_names
                else range(len(train_dataset))
            )
        ]
        self._index_of = {}
        for i, pid in enumerate(ids):
            if pid in self._index_of:
                raise ValueError(
                    f"train_dataset has a duplicate id {pid!r} (rows {self._index_of[pid]} and {i})"
                )
            self._index_of[pid] = i
        if args.per_device_train_batch_size > len(ids):
            raise ValueError(
                f"per_device_train_batch_size={args.per_device_train_batch_size} is larger than the train set "
                f"({len(ids)} problems)"
            )

        super().__init__(
            model=model,
            args=args,
            data_collator=lambda batch: batch[0],
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
        )

        self.scorer = RewardScorer(
            reward_funcs,
            reward_processing_classes,
            model_init_kwargs={"trust_remote_code": args.trust_remote_code},
            chat_template_kwargs=args.chat_template_kwargs,
            device=self.args.device,
        )
        self.reward_func_names = self.scorer.names
        if args.reward_weights is not None and len(args.reward_weights) != len(self.scorer):
            raise ValueError(
                f"DartESConfig.reward_weights has {len(args.reward_weights)} values for {len(self.scorer)} reward "
                "functions"
            )
        if args.primary_reward_index >= len(self.scorer):
            raise ValueError(
                f"DartESConfig.primary_reward_index={args.primary_reward_index} but there are only "
                f"{len(self.scorer)} reward functions"
            )
        self.reward_weights = np.asarray(args.reward_weights or [1.0] * len(self.scorer), dtype=np.float64)

        self.strategy = DartES(
            ids,
            batch_size=args.per_device_train_batch_size,
            population_size=args.population_size,
            seed=args.seed,
            antithetic=args.antithetic,
            reward_weights=self.reward_weights.tolist(),
            primary_index=args.primary_reward_index,
            solved_threshold=args.solved_threshold,
            fitness_shaping=args.fitness_shaping,
            population_layout=args.population_layout,
            members_per_group=args.members_per_group,
            use_difficulty_reweighting=args.use_difficulty_reweighting,
            use_targeted_replay=args.use_targeted_replay,
            ema_decay=args.difficulty_ema_decay,
            weight_floor=args.difficulty_weight_floor,
            weight_exponent=args.difficulty_weight_exponent,
            replay_ratio=args.replay_ratio,
            replay_pass_threshold=args.replay_pass_threshold,
            max_replays_per_epoch=args.max_replays_per_epoch,
            replay_cooldown=args.replay_cooldown,
            zero_pass_patience=args.zero_pass_patience,
        )
        if args.perturbation == "lowrank":  # EGGROLL: rank-r noise on matrices, one batched generate per step
            from ..lowrank import LowRankParameters, lora_carried_names, select_by_module

            names = lora_carried_names(self.model) if args.resolved_lowrank_targets == "lora" else None
            if args.lowrank_target_modules is not None:
                every = [n for n, p in self.model.named_parameters() if p.requires_grad]
                names = select_by_module(every if names is None else names, args.lowrank_target_modules)
            self.es_params = LowRankParameters(
                self.model,
                args.sigma,
                rank=args.perturbation_rank,
                exact_restore=args.exact_restore,
                cache_noise=self._use_noise_cache(),
                names=names,
                momentum=args.momentum,
            )
        else:
            self.es_params = EvolvedParameters(
                self.model,
                args.sigma,
                exact_restore=args.exact_restore,
                cache_noise=self._use_noise_cache(),
                momentum=args.momentum,
            )
        self.rollout = build_rollout(self)
        self._metrics: dict[str, list[float]] = defaultdict(list)
        self._last_samples: dict[str, list] | None = None  # the step's completion rows, for log_completions
        self._step_flops = 0
        self._step_committed = False
        self._torn: str | None = None  # why this trainer cannot take another step (an update failed part-way)

    # ----------------------------------------------------------------------------------------------- set-up
    def _use_noise_cache(self) -> bool:
        if self.args.noise_cache != "auto":
            return self.args.noise_cache == "on"
        n_params = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        members = math.ceil(self.args.population_size / self.accelerator.num_processes)
        return members * n_params * 4 <= self.args.noise_cache_max_gb * 2**30

    def _send_telemetry(self):  # no phoning home from an ES trainer
        return

    def create_optimizer(self, model=None):
        # Trainer's loop steps an optimizer and a scheduler; ES only needs the scheduler's learning rate.
        if self.optimizer is None:
            params = [p for p in self.model.parameters() if p.requires_grad][:1]
            self.optimizer = torch.optim.SGD(params, lr=self.args.learning_rate)
            self.optimizer.step = lambda *a, **k: None  # the ES update happens in training_step
        return self.optimizer

    def _get_grad_norm(self, model, grad_norm=None):
        return None  # ES computes no gradients: no `grad_norm` in the logs

    def get_train_dataloader(self) -> DataLoader:
        # One item per ES step of an epoch; the batch itself is planned by the strategy (fresh + replay), so the
        # loader is not sharded: every process plans the same batch.
        steps = self.strategy.planner.steps_per_epoch
        return DataLoader([{"es_step": i} for i in range(steps)], batch_size=1, collate_fn=lambda b: b[0])

    def floating_point_ops(self, inputs) -> int:
        return self._step_flops

    # --------------------------------------------------------------------------------------------- ES step
    def _rows(self, ids: Sequence[str]) -> dict[str, list[Any]]:
        return self._train_rows.select([self._index_of[i] for i in ids]).to_dict()

    def _local_members(self, n: int) -> list[int]:
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        return list(range(rank, n, world))

    def _score(
        self, columns: dict[str, list[Any]], gens, member_columns: Sequence[Sequence[int]] | None = None
    ) -> np.ndarray:
        """Rewards K×M×B of M members' generations of the B rows, in one call per function: member i's of the
        rows `member_columns[i]` (all rows without), NaN where a member did not generate (a grouped layout)."""
        b = len(columns["prompt"])
        picked = [list(range(b))] * len(gens) if member_columns is None else [list(c) for c in member_columns]
        order = [j for c in picked for j in c]
        cols = {k: [v[j] for j in order] for k, v in columns.items()}
        prompts = cols["prompt"]
        texts = [t for g in gens for t in g.texts]
        ids = [t for g in gens for t in g.token_ids]
        flat = np.asarray(
            self.scorer(
                prompts,
                as_completions(prompts, texts),
                ids,
                cols,
                trainer_state=self.state,
                log_extra=lambda *a, **k: None,
                log_metric=self._log_metric,
            )
        )
        if member_columns is None:
            return flat.reshape(len(self.scorer), len(gens), b)
        out = np.full((len(self.scorer), len(gens), b), np.nan)
        start = 0
        for i, c in enumerate(picked):
            out[:, i, c] = flat[:, start : start + len(c)]
            start += len(c)
        return out

    def _log_metric(self, name: str, value: float) -> None:
        self._metrics[name].append(float(value))

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """One ES step, all or nothing: a step that raises before its update (Ctrl-C, an engine or reward error)
        leaves the strategy state, the RNGs, the metrics and the weights as they were, so a retry gives what a
        clean step gives (`trl_dart_es.trainer.transaction`)."""
        if self._torn is not None:
            raise RuntimeError(self._torn)
        snapshot = StepSnapshot.take(self.strategy, self._metrics)
        self._step_committed = False
        try:
            return self._es_step()
        except BaseException:
            if not self._step_committed:
                snapshot.restore(self.strategy, self._metrics)
                self.es_params.restore()  # a no-op unless a rollout failed to restore
                self.es_params.clear_cache()
            raise

    def _es_step(self) -> torch.Tensor:
        args = self.args
        t_start = time.perf_counter()
        batch, members = self.strategy.ask()
        columns = self._rows(batch.ids)
        local = self._local_members(len(members))
        t_ask = time.perf_counter()

        # Grouped layout: each member generates for its own block of the batch (shared: every problem).
        member_cols = self.strategy.columns(batch) if self.strategy.layout.grouped else None
        local_cols = None if member_cols is None else [member_cols[n] for n in local]
        extra = {} if local_cols is None else {"columns": local_cols}
        gens = self.rollout.generate_population(columns["prompt"], [members[n] for n in local], **extra)
        check_population(
            gens, len(local), len(batch.ids) if local_cols is None else [len(c) for c in local_cols]
        )
        t_gen = time.perf_counter()
        local_rewards = self._score(columns, gens, local_cols)
        t_reward = time.perf_counter()

        rewards, tokens = self._gather_rewards(
            local, local_rewards, [g.num_tokens for g in gens], len(members)
        )
        t_gather = time.perf_counter()
        result = self.strategy.tell(batch, rewards)
        lr = self._get_learning_rate()
        # The update cannot be rolled back: Ctrl-C waits until it is done, and then stops training after this step.
        with held_interrupt() as interrupted:
            if result.z is not None:
                try:
                    update_norm = self.es_params.update(members, result.z, lr)
                except BaseException as exc:
                    self._torn = (
                        f"DART-ES step {self.strategy.step}: the ES update failed part-way ({exc!r}); the weights "
                        "may be partly updated, so this trainer takes no further step. Resume from the last "
                        "checkpoint (trainer.train(resume_from_checkpoint=True))."
                    )
                    raise RuntimeError(self._torn) from exc
            else:
                self.es_params.clear_cache()
                update_norm = 0.0
            self._step_committed = True
        if interrupted:
            logger.warning(
                "Ctrl-C during the ES update: step %d is complete; training stops here", self.strategy.step
            )
            self.control.should_training_stop = True
        t_end = time.perf_counter()

        self._step_flops = 2 * self.es_params.num_parameters * tokens
        # Applying members (perturb/restore, or pushing weights to an engine) is ES bookkeeping, not generation.
        perturb_time = float(getattr(self.rollout, "last_perturb_time", 0.0))
        gen_time = t_gen - t_ask - perturb_time
        self._record_step_metrics(
            result,
            rewards,
            tokens,
            len(members),
            gen_time,
            t_reward - t_gen,
            (t_ask - t_start) + (t_end - t_gather) + perturb_time,
            update_norm,
            lr,
        )
        self._metrics["time/perturb"].append(perturb_time)
        # TRL's completion metrics; with `log_completions`, the step's rows of every member (main process only)
        step_metrics, self._last_samples = record_step_completions(
            self, batch, columns["prompt"], members, local, gens, rewards, result, member_cols
        )
        for key, value in step_metrics.items():
            self._metrics[key].append(value)
        self._metrics["num_tokens"] = [float(self.state.num_input_tokens_seen)]  # a running total, as in GRPO
        self._metrics["step_time"].append(time.perf_counter() - t_start)
        mean_primary = float(np.nanmean(rewards[args.primary_reward_index])) if rewards.size else 0.0
        # Trainer logs `loss`; for ES it is the negated mean primary reward of the population.
        return torch.tensor(-mean_primary if math.isfinite(mean_primary) else 0.0, device=args.device)

    def _gather_rewards(self, local, local_rewards, local_tokens, n):
        """Assemble the K×N×B reward matrix; only rewards (and token counts) cross processes.

        Waits at most `args.ddp_timeout` seconds: a crashed, killed or stuck process makes the others stop with a
        RuntimeError that names the step and the missing rank, not hang. Every process also sends a fingerprint
        of the step's batch and population, so processes that drifted apart (different seed or data) stop too.
        """
        if self.accelerator.num_processes == 1:
            return local_rewards, int(sum(local_tokens))
        step = self.state.global_step + 1
        batch, members = self.strategy.ask()  # the pending step: asking again returns the same
        fingerprint = (tuple(batch.ids), tuple((m.seed, m.sign) for m in members))
        # One K x L x B array for this process's L members, not one per member: pickle frames each array (~100 B),
        # which at small B would outweigh the rewards themselves.
        rows = (list(local), np.ascontiguousarray(local_rewards), [int(t) for t in local_tokens])
        parts = gather_object_with_timeout(
            (fingerprint, rows), timeout=self.args.ddp_timeout, what=f"DART-ES step {step} (reward gather)"
        )
        k, _, b = local_rewards.shape
        rewards = np.full((k, n, b), np.nan)
        tokens = 0
        seen = []
        for rank, (their_fingerprint, their_rows) in enumerate(parts):
            if their_fingerprint != fingerprint:
                raise RuntimeError(
                    f"DART-ES step {step}: process {rank} planned a different batch or population than process "
                    f"{self.accelerator.process_index}. Every process must run the same code, config (seed) and "
                    "train data in the same order."
                )
            their_members, their_rewards, their_tokens = their_rows
            if their_members:
                rewards[:, their_members] = their_rewards
            tokens += sum(their_tokens)
            seen.extend(their_members)
        if sorted(seen) != list(range(n)):
            raise RuntimeError(
                f"DART-ES step {step}: gathered members {sorted(seen)}, expected 0..{n - 1} once each"
            )
        return rewards, tokens

    def _record_step_metrics(
        self, result, rewards, tokens, n, gen_time, reward_time, es_time, update_norm, lr
    ):
        m = self._metrics
        total = np.nansum(rewards * self.reward_weights[:, None, None], axis=0)  # N×B, GRPO's "reward"
        if self.strategy.layout.grouped:  # a member's total over its own block only
            total = np.where(self.strategy.layout.mask(*total.shape), total, np.nan)
        per_member = np.nanmean(total, axis=1)
        m["reward"].append(float(per_member.mean()))
        m["reward_std"].append(float(per_member.std()))
        m["frac_reward_zero_std"].append(frac_reward_zero_std(total))
        for k, name in enumerate(self.reward_func_names):
            per = np.nanmean(rewards[k], axis=1) if np.isfinite(rewards[k]).any() else np.full(n, np.nan)
            m[f"rewards/{name}/mean"].append(float(np.nanmean(per)))
            m[f"rewards/{name}/std"].append(float(np.nanstd(per)))
        for key, value in result.metrics.items():
            m[key].append(float(value))
        m["update_norm"].append(float(update_norm))
        m["es/learning_rate"].append(float(lr))
        m["time/generation"].append(gen_time)
        m["time/reward"].append(reward_time)
        m["time/es"].append(es_time)
        m["tokens_per_s"].append(tokens / gen_time if gen_time > 0 else 0.0)

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, *args, **kwargs) -> None:
        # Every process holds the same loss, and Trainer logs the mean of their copies. In float32, summing more
        # than two copies can round the last bit, so 8 processes would log a loss 1 ulp from one process's. In
        # float64 the sum of P copies of a float32 value is exact, and so is its mean: the log does not depend on P.
        exact = tr_loss.double()
        super()._maybe_log_save_evaluate(exact, *args, **kwargs)
        tr_loss.copy_(exact)  # Trainer resets the accumulated loss in place when it logs

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        training = not any(k.startswith("eval_") for k in logs)
        if training:
            for key, values in self._metrics.items():
                valid = [v for v in values if not math.isnan(v)]
                logs[key] = sum(valid) / len(valid) if valid else None
            self._metrics.clear()
        super().log(logs, start_time)
        # After Trainer's log, as GRPO does: the trackers have started and the step's scalars are in.
        if training and self._last_samples and self.args.log_completions and self.accelerator.is_main_process:
            log_completions(self, self._last_samples)
            self._last_samples = None

    # ------------------------------------------------------------------------------------------ evaluation
    def evaluate(
        self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Greedy evaluation of the unperturbed model: reward, per-reward means, and accuracy."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset")
        if isinstance(dataset, dict):
            metrics = {}
            for name, ds in dataset.items():
                metrics.update(self.evaluate(ds, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        metrics = self.evaluate_dataset(dataset, metric_key_prefix)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def evaluate_dataset(
        self, dataset: Dataset, metric_key_prefix: str = "eval", *, return_solved: bool = False
    ) -> dict[str, float] | tuple[dict[str, float], np.ndarray]:
        """Metrics of the unperturbed model on `dataset` (no logging); shards rows across processes.

        With `return_solved`, also a boolean array in `dataset`'s row order: whether each row was solved (its
        primary reward reached `solved_threshold`), so that two evaluations can be compared row by row.
        """
        if self.es_params.is_perturbed:
            self.es_params.restore()
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        rows = dataset.select(range(rank, len(dataset), world))
        size = self.args.per_device_eval_batch_size
        local = []
        starts = range(0, len(rows), size)
        for start in tqdm(
            starts, desc="Evaluating", disable=self.args.disable_tqdm or not self.is_world_process_zero()
        ):
            columns = rows.select(range(start, min(start + size, len(rows)))).to_dict()
            gen = self.rollout.generate(columns["prompt"])
            check_population([gen], 1, len(columns["prompt"]))
            clipped = gen.num_clipped(self.args.max_completion_length, self.eos_token_ids)
            groups = {c: columns[c] for c in ACCURACY_GROUPS if c in columns}
            local.append((self._score(columns, [gen])[:, 0], gen.num_tokens, clipped, groups))
        if world > 1:
            what = f"evaluation ({metric_key_prefix})"
            per_rank = gather_object_with_timeout(local, timeout=self.args.ddp_timeout, what=what)
            parts = [part for rank_parts in per_rank for part in rank_parts]
        else:
            parts = local
        empty = np.zeros((len(self.scorer), 0))
        # Groups where every row says (accuracy per difficulty level and per wording).
        groups = {
            c: [v for part in parts for v in part[3][c]]
            for c in ACCURACY_GROUPS
            if all(c in part[3] for part in parts)
        }
        metrics = held_out_metrics(
            np.concatenate([part[0] for part in parts], axis=1) if parts else empty,
            self.reward_func_names,
            self.reward_weights,
            primary_reward_index=self.args.primary_reward_index,
            solved_threshold=self.args.solved_threshold,
            tokens=sum(part[1] for part in parts),
            clipped=sum(part[2] for part in parts),
            groups=groups,
        )
        metrics = {f"{metric_key_prefix}_{key}": value for key, value in metrics.items()}
        if not return_solved:
            return metrics
        primary = np.concatenate([part[0][self.args.primary_reward_index] for part in parts]) if parts else []
        solved = solved_matrix(np.reshape(primary, (1, -1)), self.args.solved_threshold)[0].astype(bool)
        return metrics, strided_to_dataset_order(solved, world)

    # --------------------------------------------------------------------------------- checkpoint / resume
    def _save_checkpoint(self, model, trial):
        if self.es_params.is_perturbed:  # never write a checkpoint from perturbed weights
            self.es_params.restore()
        # Before anything is written: a peer lost here leaves no partial checkpoint behind.
        self._rng_files = self._gather_rng_files(f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        try:
            self.create_model_card(model_name=os.path.basename(os.path.normpath(self.args.output_dir)))
            super()._save_checkpoint(model, trial)
        finally:
            self._rng_files = None

    def _gather_rng_files(self, checkpoint: str) -> list[tuple[str, bytes]] | None:
        """Every rank's `rng_state_<rank>.pth` (name, bytes), on every rank; None with one process.

        Trainer writes that file from every process. On machines without shared storage, machine 0's checkpoint
        would then lack the other ranks' states, and the other machines would grow one-file `checkpoint-*`
        folders. Instead the files (a few KB each) travel to the process that saves, which writes them all."""
        if self.args.world_size <= 1:
            return None
        name = f"rng_state_{self.args.process_index}.pth"
        with tempfile.TemporaryDirectory() as tmp:
            super()._save_rng_state(tmp)  # Trainer's own file, so a resume reads it as it always does
            with open(os.path.join(tmp, name), "rb") as f:
                data = f.read()
        return gather_object_with_timeout(
            (name, data), timeout=self.args.ddp_timeout, what=f"DART-ES {checkpoint} (RNG states)"
        )

    def _save_rng_state(self, output_dir: str) -> None:
        files = getattr(self, "_rng_files", None)
        if files is None:  # one process
            super()._save_rng_state(output_dir)
        elif self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            for name, data in files:
                with open(os.path.join(output_dir, name), "wb") as f:
                    f.write(data)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if not self.args.should_save:
            return
        state = {
            **self.strategy.state_dict(),
            "trajectory": trajectory_settings(self.args, self.es_params.names),
        }
        with open(os.path.join(output_dir, DART_STATE_NAME), "w") as f:
            json.dump(state, f)
        master = self.es_params.master_state_dict() if hasattr(self.es_params, "master_state_dict") else None
        if master:  # fp32 master weights of a 16-bit model: the saved model alone would lose precision
            save_file(
                {k: v.contiguous() for k, v in master.items()}, os.path.join(output_dir, MASTER_WEIGHTS_NAME)
            )
        if velocity := self.es_params.velocity_state_dict():
            save_file(velocity, os.path.join(output_dir, VELOCITY_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # Before any weight is loaded: a resume under settings that change the trajectory is refused.
        path = os.path.join(resume_from_checkpoint, DART_STATE_NAME)
        if os.path.exists(path):
            with open(path) as f:
                saved = json.load(f).get("trajectory")
            current = trajectory_settings(self.args, self.es_params.names)
            check_resume_settings(saved, current, resume_from_checkpoint)
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, DART_STATE_NAME)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"{checkpoint} has no {DART_STATE_NAME}: it was not written by DartESTrainer, or with "
                "save_only_model=True, so the DART state (difficulty, replay, planner) cannot be resumed"
            )
        with open(path) as f:
            self.strategy.load_state_dict(json.load(f))
        self._es_weights_from(checkpoint)
        velocity = os.path.join(checkpoint, VELOCITY_NAME)
        if self.args.momentum and os.path.exists(velocity):
            self.es_params.load_velocity_state_dict(load_file(velocity))
        elif self.args.momentum:  # a checkpoint of a run without momentum
            logger.warning(f"{checkpoint} has no {VELOCITY_NAME}: momentum starts from zero at this resume")
        self._torn = None  # weights and state come from the checkpoint again: a torn update is behind us

    def _load_best_model(self) -> None:
        """`load_best_model_at_end`: Trainer loads the best checkpoint's weights; the ES state then follows them
        (its exact-restore base, and a 16-bit model's fp32 master), or the next restore would bring back the last
        step's weights."""
        if self.es_params.is_perturbed:
            self.es_params.restore()
        super()._load_best_model()
        self._es_weights_from(self.state.best_model_checkpoint)

    def _es_weights_from(self, checkpoint: str) -> None:
        """After Trainer loaded `checkpoint`'s weights into the model: the ES base follows them, and a 16-bit
        model's fp32 master comes from the checkpoint's master file."""
        self.es_params.sync_from_model()
        master = os.path.join(checkpoint, MASTER_WEIGHTS_NAME)
        if os.path.exists(master):
            self.es_params.load_master_state_dict(load_file(master))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self.es_params.is_perturbed:
            self.es_params.restore()
        super().save_model(output_dir, _internal_call)
        if not _internal_call and self.is_world_process_zero():
            self.create_model_card(
                model_name=os.path.basename(os.path.normpath(output_dir or self.args.output_dir))
            )

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None, tags=None):
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if not self.is_world_process_zero():
            return
        a = self.args
        keys = [*REFUSED_ON_RESUME, *WARNED_ON_RESUME]  # the settings that decide the trajectory
        lines = ["", "## DART-ES hyperparameters", "", "| name | value |", "| --- | --- |"]
        lines += [f"| `{k}` | {getattr(a, k)} |" for k in keys]
        lines += [
            "",
            f"Reward functions: {', '.join(self.reward_func_names)} (weights {self.reward_weights.tolist()}).",
            "",
        ]
        with open(os.path.join(a.output_dir, "README.md"), "a") as f:
            f.write("\n".join(lines))
