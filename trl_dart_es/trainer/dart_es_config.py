"""Configuration of `DartESTrainer`: `transformers.TrainingArguments` plus the ES and DART fields.

Fields that mean the same as in TRL's `GRPOConfig` keep GRPO's name. Defaults follow the reference values of
the DART-ES paper (see docs/method.md), with greedy decoding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from ..distributed import check_not_sharded
from ..fitness import FITNESS_SHAPING as _SHAPINGS
from ..layout import PopulationLayout

_PERTURBATIONS = ("full", "lowrank")
_LOWRANK_TARGETS = ("auto", "all", "lora")
_VLLM_LORA_KERNELS = ("grouped", "vllm")
_VLLM_MODES = ("colocate",)
_NOISE_CACHE = ("auto", "on", "off")


@dataclass
class DartESConfig(TrainingArguments):
    r"""
    Configuration for [`DartESTrainer`].

    One training step is one ES step: every member of a population of `population_size` perturbations of the
    model answers the same `per_device_train_batch_size` problems, and the model moves along the
    fitness-weighted sum of the perturbations. No gradients and no optimizer state are used.

    Only the ES/DART-specific parameters are listed here; the rest are those of
    [`~transformers.TrainingArguments`] and, where the name matches, they mean what they mean in TRL's
    `GRPOConfig`.
    """

    # Defaults overridden from TrainingArguments.
    learning_rate: float = field(
        default=2.5e-4,
        metadata={"help": "ES step size α: θ ← θ + (α/N) Σ z_n ε_n (no 1/σ). The reference run uses 2.5e-4."},
    )
    per_device_train_batch_size: int = field(
        default=256,
        metadata={"help": "Problems per ES step (B): every population member answers these same problems."},
    )
    per_device_eval_batch_size: int = field(
        default=64, metadata={"help": "Prompts per generation call during evaluation."}
    )
    lr_scheduler_type: str = field(
        default="constant",
        metadata={"help": "Schedule of α over steps. The reference keeps α constant."},
    )
    warmup_steps: float = field(default=0, metadata={"help": "Warm-up steps of the α schedule."})
    max_grad_norm: float = field(default=0.0, metadata={"help": "Unused: ES computes no gradients."})
    logging_steps: float = field(default=1, metadata={"help": "Log every X ES steps."})
    report_to: str | list[str] = field(default="none", metadata={"help": "Integrations to report to."})
    save_strategy: str = field(
        default="no", metadata={"help": "Checkpoint strategy ('no', 'steps', 'epoch')."}
    )
    use_cpu: bool = field(
        default=False, metadata={"help": "Run on CPU even when an accelerator is available."}
    )

    # Model
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments for `from_pretrained` when `model` is a string (as in GRPOConfig)."
        },
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow custom model code from the hub. Off unless you turn it on."}
    )
    disable_dropout: bool = field(
        default=True, metadata={"help": "Disable dropout: members must differ only by their perturbation."}
    )

    # Generation (GRPO names)
    max_completion_length: int = field(
        default=256, metadata={"help": "Maximum tokens generated per completion."}
    )
    temperature: float = field(
        default=0.0, metadata={"help": "Sampling temperature. 0 means greedy decoding (the reference)."}
    )
    top_p: float = field(default=1.0, metadata={"help": "Top-p sampling (only when temperature > 0)."})
    top_k: int = field(
        default=0, metadata={"help": "Top-k sampling; 0 disables it (only when temperature > 0)."}
    )
    min_p: float | None = field(
        default=None, metadata={"help": "Min-p sampling (only when temperature > 0)."}
    )
    repetition_penalty: float = field(default=1.0, metadata={"help": "Repetition penalty (1.0 = none)."})
    generation_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Extra keyword arguments for generation (GenerationConfig / SamplingParams)."},
    )
    generation_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Rows per `generate` call. Full rank: prompts of one member (default: all B). Low rank: rows "
            "of the whole population, in whole member blocks when >= B (default: all N × B in one call). "
            "Ignored with vLLM."
        },
    )
    chat_template_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Extra keyword arguments for the chat template (conversational data)."},
    )

    # Rewards
    reward_weights: list[float] | None = field(
        default=None,
        metadata={"help": "Weight β_k of each reward function in the fitness. Default: 1.0 for each."},
    )
    primary_reward_index: int = field(
        default=0,
        metadata={
            "help": "Index of the primary (correctness) reward: it defines 'solved' and gets DART weights."
        },
    )
    solved_threshold: float = field(
        default=1.0, metadata={"help": "A member solves a problem when its primary reward is at least this."}
    )

    # Evolution strategy
    population_size: int = field(default=40, metadata={"help": "Population size N (perturbations per step)."})
    sigma: float = field(default=1.5e-3, metadata={"help": "Noise scale σ of the perturbations."})
    antithetic: bool = field(
        default=False,
        metadata={"help": "Mirrored sampling: members in ± pairs (population_size must be even)."},
    )
    fitness_shaping: str = field(
        default="zscore",
        metadata={
            "help": "'zscore' (reference), 'rank' (centred ranks) or 'running-zscore' (centred fitness over the "
            "mean fitness std of the run's steps so far: steps with small fitness differences move less)."
        },
    )
    momentum: float = field(
        default=0.0,
        metadata={
            "help": "Momentum mu in [0, 1) on the ES update (an option; 0 is the reference). Each step applies the "
            "running update v <- mu v + (1 - mu) delta (fp32, saved with checkpoints) instead of the step's own "
            "delta: a direction that repeats keeps plain ES's step length, and steps whose directions are noise "
            "average out. Costs 4 bytes per evolved parameter. A skipped step (no signal) moves nothing."
        },
    )
    population_layout: str = field(
        default="shared",
        metadata={
            "help": "Which problems each member scores. 'shared' (the reference): every member scores all "
            "per_device_train_batch_size problems of the step. 'grouped' (EGGROLL's layout): members form groups of "
            "members_per_group, the step's problems split into one equal block per group, and each group scores "
            "its own block (members_per_group x per_device_train_batch_size rollouts per step); fitness is centred "
            "within each group. See docs/method.md."
        },
    )
    members_per_group: int | None = field(
        default=None,
        metadata={
            "help": "Grouped layout: members that score each block of problems (even with antithetic pairs). "
            "population_size must be a multiple of it and per_device_train_batch_size a multiple of "
            "population_size / members_per_group. None with the shared layout."
        },
    )
    perturbation: str = field(
        default="full",
        metadata={
            "help": "'full': full-rank Gaussian noise per parameter (the reference). 'lowrank': rank-r noise on "
            "linear weights (EGGROLL), so the whole population runs as one batched generation."
        },
    )
    perturbation_rank: int = field(default=1, metadata={"help": "Rank r of the low-rank perturbations."})
    lowrank_targets: str = field(
        default="auto",
        metadata={
            "help": "Which trainable tensors evolve with perturbation='lowrank'. 'all': every one (matrices and "
            "embeddings low-rank, norm gains and biases full-rank). 'lora': only the weights of linear layers, "
            "which a LoRA adapter can carry (attention and MLP projections); embeddings, the output head, norms "
            "and biases stay fixed (neither perturbed nor updated), as vLLM's per-member LoRA adapters require. "
            "'auto': 'lora' with use_vllm=True, else 'all'. Set 'lora' on the transformers backend to run the "
            "same algorithm as with vLLM."
        },
    )
    lowrank_target_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "With perturbation='lowrank': evolve only the tensors of modules with these names, matched on "
            "the last component of the module path as PEFT's `target_modules` is (e.g. ['gate_proj', 'up_proj', "
            "'down_proj'] for the MLPs only), within the set `lowrank_targets` selects. None: that whole set."
        },
    )
    exact_restore: bool = field(
        default=True,
        metadata={
            "help": "Keep fp32 master weights: restore is bitwise exact and updates accumulate in fp32 "
            "(improvement). With low rank, an fp32 model copies a matrix only when a member is first materialised "
            "in the weights, which the batched and vLLM rollouts never do. False: add/subtract noise in place in "
            "the model dtype, as the paper's code does."
        },
    )
    noise_cache: str = field(
        default="auto",
        metadata={
            "help": "Keep each member's noise between evaluation and update: 'on', 'off', or 'auto' (on when "
            "N × trainable parameters × 4 bytes fits in `noise_cache_max_gb`)."
        },
    )
    noise_cache_max_gb: float = field(
        default=1.0,
        metadata={
            "help": "Memory budget of the noise cache (GiB, per process). Small on purpose: ES's memory lead over "
            "GRPO comes first; the cache only saves the second noise draw of the update (~5% of a CPU step)."
        },
    )

    # DART: difficulty-aware reweighting
    use_difficulty_reweighting: bool = field(
        default=True,
        metadata={"help": "Weight the primary reward by w_j = w_floor + exp(-κ p̄_j). Off: w ≡ 1."},
    )
    difficulty_ema_decay: float = field(
        default=0.7, metadata={"help": "EMA decay λ of the per-problem pass rate."}
    )
    difficulty_weight_floor: float = field(default=0.8, metadata={"help": "Weight floor w_floor."})
    difficulty_weight_exponent: float = field(default=3.0, metadata={"help": "Weight exponent κ."})

    # DART: targeted replay
    use_targeted_replay: bool = field(
        default=True, metadata={"help": "Replay rare-solvable problems. Off: every slot is a fresh problem."}
    )
    replay_ratio: float = field(default=0.2, metadata={"help": "Fraction ρ of the batch given to replay."})
    replay_pass_threshold: float = field(
        default=0.5, metadata={"help": "τ: a problem with p̄ ≥ τ counts as mastered and leaves the buffer."}
    )
    max_replays_per_epoch: int = field(
        default=2, metadata={"help": "Maximum replays of one problem per epoch."}
    )
    replay_cooldown: int = field(
        default=1, metadata={"help": "Steps a problem waits before it is replayed again."}
    )
    zero_pass_patience: int = field(
        default=2,
        metadata={"help": "P: unsolved by every member this many visits in a row → leaves the buffer."},
    )

    # vLLM (GRPO names)
    use_vllm: bool = field(default=False, metadata={"help": "Generate with vLLM (one engine per process)."})
    vllm_mode: str = field(
        default="colocate", metadata={"help": "Only 'colocate': the engine lives in the process."}
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3, metadata={"help": "GPU memory fraction for the vLLM engine (CUDA)."}
    )
    vllm_tensor_parallel_size: int = field(
        default=1, metadata={"help": "Tensor parallel size of the vLLM engine."}
    )
    vllm_max_model_length: int | None = field(
        default=None, metadata={"help": "Context length of the vLLM engine. Default: the model's."}
    )
    vllm_enable_sleep_mode: bool = field(
        default=False, metadata={"help": "Let the vLLM engine sleep between steps (CUDA only)."}
    )
    vllm_enable_prefix_caching: bool = field(
        default=False,
        metadata={
            "help": "Improvement: let vLLM compute a prompt prefix shared by the prompts of one generate call once "
            "(per adapter) instead of once per prompt. The cache is emptied before every call, because the weights "
            "change between calls, so results match the engine without it up to float rounding. Pays when prompts "
            "share a long prefix (a system prompt, few-shot examples): on CPU only whole blocks of 32 tokens are "
            "shared (docs/vllm.md 'Prefix caching'). False: every prompt computed in full, the reference."
        },
    )
    generation_dtype: str | None = field(
        default=None,
        metadata={
            "help": "Improvement: the precision generation runs in, apart from the evolved weights' dtype (their "
            "fp32 master keeps every perturbation and update exact; the vLLM engine, or with use_vllm=False a "
            "generation copy of the model, gets them rounded after each change, so rounding never accumulates). "
            "None: the model's dtype (the reference). 'auto': bfloat16 for an fp32 model where the CPU "
            "(avx512_bf16 or AMX) or GPU computes bf16 natively, else the model's dtype. 'float32', 'bfloat16', "
            "'float16': that dtype (docs/vllm.md 'Generation precision')."
        },
    )
    vllm_cpu_kvcache_space: int = field(
        default=4, metadata={"help": "KV-cache size in GiB for vLLM on CPU (VLLM_CPU_KVCACHE_SPACE)."}
    )
    vllm_cpu_threads: int | None = field(
        default=None,
        metadata={
            "help": "Torch threads of each process once its vLLM engine has started on CPU (the engine and the "
            "trainer share them). None: the process's share of the cores, cores // processes on this node (2 "
            "threads beat 1 on both vLLM paths, docs/vllm.md 'Threads'). Capped at that share. An OMP_NUM_THREADS "
            "in the environment always wins (accelerate launch sets it)."
        },
    )
    vllm_lora_kernel: str = field(
        default="grouped",
        metadata={
            "help": "Multi-LoRA ops of the vLLM low-rank population on CPU. 'grouped' (improvement, default): every "
            "adapter of a layer in one small GEMM, no per-token copy of the adapter weights (generation 1.6x "
            "faster on the quickstart, docs/vllm.md). 'vllm': vLLM's own CPU Punica ops."
        },
    )

    vllm_engine_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Extra keyword arguments for `vllm.LLM`, for the engine's scheduling, e.g. "
            '\'{"max_num_seqs": 128, "max_num_batched_tokens": 8192}\' (a dict, or JSON on the command line). '
            "Settings the trainer makes itself (model, dtype, seed, LoRA slots, prefix caching, ...) are refused: "
            "use their own fields. None: vLLM's defaults (docs/vllm.md 'Throughput settings')."
        },
    )

    # Logging
    log_completions: bool = field(
        default=False,
        metadata={
            "help": "As in GRPO: at each logging step, print a rich table of sample completions, write every member's "
            "completions of the step to `output_dir/completions/completions_<step>.parquet`, and send a `completions` "
            "table to trackio/wandb (TensorBoard: Markdown text) when they are in `report_to`."
        },
    )
    num_completions_to_print: int | None = field(
        default=4,
        metadata={
            "help": "Rows of the console table with `log_completions` (None: all; the files get every row)."
        },
    )
    completions_print_steps: int | None = field(
        default=None,
        metadata={
            "help": "With `log_completions`, print the console table only at steps that are multiples of this "
            "(None: at every logging step, as GRPO). The parquet files and tracker tables keep every logging step. "
            "A long run's console then shows one metrics line per step and a table now and then."
        },
    )

    def __post_init__(self):
        check_not_sharded(self)  # before TrainingArguments sets up DeepSpeed/FSDP and fails less clearly
        for name in ("model_init_kwargs", "generation_kwargs", "chat_template_kwargs", "vllm_engine_kwargs"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, json.loads(value))
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            self.metric_for_best_model = "reward"  # ES computes no eval loss (Trainer's default metric)
        super().__post_init__()
        self._validate()

    @property
    def resolved_lowrank_targets(self) -> str | None:
        """'all' or 'lora' with perturbation='lowrank' ('auto' resolved), else None."""
        if self.perturbation != "lowrank":
            return None
        if self.lowrank_targets == "auto":
            return "lora" if self.use_vllm else "all"
        return self.lowrank_targets

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"DartESConfig.{name}={getattr(self, name)!r} is invalid: {why}")

        if self.population_size < 2:
            raise bad("population_size", "ES needs at least 2 members")
        if self.completions_print_steps is not None and self.completions_print_steps < 1:
            raise bad("completions_print_steps", "print every k >= 1 steps, or None for every logging step")
        if self.antithetic and self.population_size % 2:
            raise bad("population_size", "antithetic sampling needs an even population")
        if not self.sigma > 0:
            raise bad("sigma", "must be > 0")
        if not self.learning_rate > 0:
            raise bad("learning_rate", "must be > 0")
        if self.per_device_train_batch_size < 1:
            raise bad("per_device_train_batch_size", "must be >= 1")
        if self.gradient_accumulation_steps != 1:
            raise bad("gradient_accumulation_steps", "ES has no gradients to accumulate; use a larger batch")
        if self.fitness_shaping not in _SHAPINGS:
            raise bad("fitness_shaping", f"choose one of {_SHAPINGS}")
        if not 0.0 <= self.momentum < 1.0:
            raise bad("momentum", "choose mu in [0, 1); 0 switches momentum off")
        if self.momentum and not self.exact_restore:
            raise bad("momentum", "momentum keeps its running update in fp32 and needs exact_restore=True")
        try:
            layout = PopulationLayout(self.population_layout, self.members_per_group)
            layout.check(self.population_size, self.per_device_train_batch_size, self.antithetic)
        except ValueError as exc:
            raise ValueError(f"DartESConfig: {exc}") from None
        if layout.grouped and self.fitness_shaping == "rank":
            raise bad(
                "fitness_shaping", "ranks are not defined across groups: use 'zscore' or 'running-zscore'"
            )
        if self.perturbation not in _PERTURBATIONS:
            raise bad("perturbation", f"choose one of {_PERTURBATIONS}")
        if self.perturbation_rank < 1:
            raise bad("perturbation_rank", "must be >= 1")
        if self.noise_cache not in _NOISE_CACHE:
            raise bad("noise_cache", f"choose one of {_NOISE_CACHE}")
        if not 0.0 <= self.replay_ratio < 1.0:
            raise bad("replay_ratio", "must be in [0, 1)")
        if not 0.0 <= self.difficulty_ema_decay < 1.0:
            raise bad("difficulty_ema_decay", "must be in [0, 1)")
        if self.difficulty_weight_floor < 0:
            raise bad("difficulty_weight_floor", "must be >= 0")
        if self.difficulty_weight_exponent < 0:
            raise bad("difficulty_weight_exponent", "must be >= 0")
        if not 0.0 < self.replay_pass_threshold <= 1.0:
            raise bad("replay_pass_threshold", "must be in (0, 1]")
        if self.max_replays_per_epoch < 0:
            raise bad("max_replays_per_epoch", "must be >= 0")
        if self.replay_cooldown < 0:
            raise bad("replay_cooldown", "must be >= 0")
        if self.zero_pass_patience < 1:
            raise bad("zero_pass_patience", "must be >= 1")
        if self.primary_reward_index < 0:
            raise bad("primary_reward_index", "must be >= 0")
        if self.max_completion_length < 1:
            raise bad("max_completion_length", "must be >= 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0 (0 = greedy)")
        if self.generation_batch_size is not None and self.generation_batch_size < 1:
            raise bad("generation_batch_size", "must be >= 1")
        if self.vllm_mode not in _VLLM_MODES:
            raise bad("vllm_mode", f"only {_VLLM_MODES} is supported: the engine must share the process")
        if self.vllm_cpu_threads is not None and (
            isinstance(self.vllm_cpu_threads, bool)
            or not isinstance(self.vllm_cpu_threads, int)
            or self.vllm_cpu_threads < 1
        ):
            raise bad("vllm_cpu_threads", "use a positive integer, or None for the measured default")
        if self.vllm_lora_kernel not in _VLLM_LORA_KERNELS:
            raise bad("vllm_lora_kernel", f"choose one of {_VLLM_LORA_KERNELS}")
        if self.generation_dtype is not None:
            from ..precision import GENERATION_DTYPES

            if self.generation_dtype not in GENERATION_DTYPES:
                raise bad(
                    "generation_dtype", f"choose one of {GENERATION_DTYPES}, or None for the model's dtype"
                )
        if self.lowrank_targets not in _LOWRANK_TARGETS:
            raise bad("lowrank_targets", f"choose one of {_LOWRANK_TARGETS}")
        if self.lowrank_targets != "auto" and self.perturbation != "lowrank":
            raise bad("lowrank_targets", "only applies to perturbation='lowrank'; leave it 'auto'")
        if self.use_vllm and self.perturbation == "lowrank" and self.lowrank_targets == "all":
            raise bad(
                "lowrank_targets",
                "with use_vllm=True each member is a LoRA adapter, which cannot carry embeddings, the output "
                "head, norms or biases; use 'lora' (or 'auto'), or use_vllm=False to evolve every tensor",
            )
        if self.lowrank_target_modules is not None:
            if self.perturbation != "lowrank":
                raise bad("lowrank_target_modules", "only applies to perturbation='lowrank'; leave it None")
            if isinstance(self.lowrank_target_modules, str):
                self.lowrank_target_modules = [self.lowrank_target_modules]
            if not self.lowrank_target_modules or not all(
                isinstance(m, str) and m for m in self.lowrank_target_modules
            ):
                raise bad("lowrank_target_modules", "give a non-empty list of module names, or None")
        if self.reward_weights is not None and any(w != w for w in self.reward_weights):
            raise bad("reward_weights", "NaN weight")
