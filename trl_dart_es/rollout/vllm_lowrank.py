"""Low-rank population rollouts with vLLM: every member is a LoRA adapter of one engine, one `generate` per step.

A rank-r ES perturbation of a linear weight, ``sign * sigma * A @ B.T / sqrt(r)``, is exactly a LoRA delta
``lora_B @ lora_A`` with ``lora_A = B.T`` (``r x in``) and ``lora_B = (sign * sigma / sqrt(r)) * A``
(``out x r``), served with scaling 1 (``lora_alpha = r``). The factors are those of
:class:`~trl_dart_es.lowrank.LowRankParameters` (same seed, same name, same numbers as the transformers
low-rank backend), so both backends evaluate the same population.

Per step:

1. the engine is given the model's base weights, with the existing weight push, only when it does not hold
   them already (once per step, after the update);
2. every local member's factors become one adapter, handed over in memory (``handover="memory"``: built into
   a `LoRAModel` inside the worker, which lives in this process) or as a small PEFT folder on a RAM-backed
   temporary folder (``handover="files"``: ``/dev/shm``, loaded by vLLM's own adapter loader);
3. all N x B prompts go to the engine in ONE ``generate`` call, row ``i`` with the adapter of member
   ``i // B``;
4. the adapters are removed. Their ids are fresh every step (a counter), so vLLM's adapter cache can never
   serve a previous step's factors under a reused id.

Only the weights of linear layers are carried (``DartESConfig.lowrank_targets='lora'``,
:func:`~trl_dart_es.lowrank.lora_carried_names`): embeddings, the output head, norms and biases stay fixed.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig

from ..lowrank import LowRankParameters, owning_module
from ..noise import Member
from .base import Generation, member_columns
from .vllm import VLLMRollout
from .vllm_engine import _Engine, _is_peft_model, start_engine_for_trainer

__all__ = ["VLLMLowRankRollout", "member_adapter_tensors"]

_HANDOVERS = ("memory", "files")
_PEFT_PREFIX = "base_model.model."
_ADAPTER_IDS = itertools.count(1)  # process-wide: adapter ids are never reused


def member_adapter_tensors(
    params: LowRankParameters, member: Member, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Member ``member``'s perturbation of every low-rank matrix of ``params`` as PEFT-named LoRA tensors.

    ``lora_A = B^T`` (``r x in``), ``lora_B = c * A`` (``out x r``) with ``c = sign * sigma / sqrt(r)``: with
    scaling 1, ``lora_B @ lora_A = c * A @ B^T``, the perturbation the transformers backend applies (its hook
    uses the same ``c * A`` and ``B`` in the same dtype).
    """
    coef = member.sign * params.sigma / math.sqrt(params.rank)
    out: dict[str, torch.Tensor] = {}
    for name in params.lowrank_names:
        if not name.endswith(".weight"):
            raise ValueError(f"{name!r} is not a linear layer's weight: a LoRA adapter cannot carry it")
        a, b = params.factors(member, name)  # (m, r), (n, r), float32
        module = _PEFT_PREFIX + name.removesuffix(".weight")
        out[f"{module}.lora_A.weight"] = b.T.to(dtype).contiguous()
        out[f"{module}.lora_B.weight"] = (a * coef).to(dtype).contiguous()
    return out


def _adapter_config(params: LowRankParameters) -> dict[str, Any]:
    modules = sorted({owning_module(n) for n in params.lowrank_names})
    # lora_alpha = r: vLLM's scaling alpha / r is exactly 1, so lora_B is used as given.
    return {
        "peft_type": "LORA",
        "r": params.rank,
        "lora_alpha": params.rank,
        "target_modules": modules,
        "bias": "none",
    }


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class VLLMLowRankRollout(VLLMRollout):
    """Generates a low-rank population with one vLLM engine: one LoRA adapter per member, one `generate`.

    Args:
        model: the trainer's model (a plain `PreTrainedModel`; PEFT models are refused).
        tokenizer: renders and tokenizes prompts, decodes completions.
        generation_config: decoding settings (see :func:`~trl_dart_es.rollout.vllm.sampling_params_kwargs`).
        params: the trainer's `LowRankParameters`; every evolved tensor must be a linear layer's weight.
        engine: from :func:`~trl_dart_es.rollout.vllm.start_engine` with ``max_loras`` >= the local members.
        handover: ``"memory"`` (adapters built in the worker from in-memory tensors) or ``"files"`` (PEFT
            folders on ``/dev/shm``, loaded through vLLM's `LoRARequest` path).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        generation_config: GenerationConfig,
        params: LowRankParameters,
        engine: _Engine,
        *,
        handover: str = "memory",
        generation_kwargs: dict | None = None,
        chat_template_kwargs: dict | None = None,
        sampling_seed: int = 0,
    ):
        if not isinstance(params, LowRankParameters):
            raise TypeError(f"VLLMLowRankRollout needs LowRankParameters, got {type(params).__name__}")
        if handover not in _HANDOVERS:
            raise ValueError(f"handover={handover!r}: choose one of {_HANDOVERS}")
        if _is_peft_model(model):
            raise NotImplementedError(
                "use_vllm=True with perturbation='lowrank' serves members as LoRA adapters of the base model; "
                "a PEFT model cannot be evolved this way (use use_vllm=False)"
            )
        if params.fullrank_names:
            raise ValueError(
                f"vLLM's LoRA adapters cannot carry {params.fullrank_names[:3]}...: build the parameters with "
                "names=lora_carried_names(model) (DartESConfig.lowrank_targets='lora')"
            )
        super().__init__(
            model,
            tokenizer,
            generation_config,
            params,
            engine,
            generation_kwargs=generation_kwargs,
            chat_template_kwargs=chat_template_kwargs,
            sampling_seed=sampling_seed,
        )
        self.handover = handover
        self.last_perturb_time = 0.0
        self._dtype = engine.dtype or next(model.parameters()).dtype  # adapters in the engine's precision
        self._config = _adapter_config(params)
        self._check_engine_supports(params)

    @classmethod
    def from_trainer(cls, trainer, generation_config: GenerationConfig) -> VLLMLowRankRollout:
        """The rollout of a `DartESTrainer` with ``use_vllm=True, perturbation='lowrank'``."""
        args = trainer.args
        local = math.ceil(args.population_size / trainer.accelerator.num_processes)
        engine = start_engine_for_trainer(trainer, max_loras=local, max_lora_rank=args.perturbation_rank)
        return cls(
            trainer.model,
            trainer.processing_class,
            generation_config,
            trainer.es_params,
            engine,
            generation_kwargs=args.generation_kwargs,
            chat_template_kwargs=args.chat_template_kwargs,
            sampling_seed=args.seed,
        )

    # --------------------------------------------------------------------------------------- internals
    @property
    def max_loras(self) -> int:
        lora = self.engine.key[6] if len(self.engine.key) > 6 else None
        if lora is None:
            raise ValueError("the vLLM engine was started without LoRA (start_engine(..., max_loras=N))")
        return lora[0]

    def _check_engine_supports(self, params: LowRankParameters) -> None:
        self.max_loras  # noqa: B018 - raises when the engine has no LoRA
        expected = self.engine.llm.collective_rpc(_expected_lora_modules)[0]
        if expected is None:  # a stand-in engine (tests): nothing to check
            return
        missing = sorted(set(self._config["target_modules"]) - set(expected))
        if missing:
            raise NotImplementedError(
                f"vLLM's LoRA support for this architecture does not cover {missing} (it covers "
                f"{sorted(expected)}); freeze those layers or use use_vllm=False"
            )

    def _adapter_requests(self, members: Sequence[Member]) -> tuple[list, str | None]:
        """One `LoRARequest` per member under a fresh id (and, for ``handover="files"``, its folder); nothing is
        loaded yet, so a caller can remove every one of them whatever happens next."""
        from vllm.lora.request import LoRARequest

        ids = [next(_ADAPTER_IDS) for _ in members]
        if self.handover == "memory":
            # The path is never read: the adapters are put in the worker's cache under these ids.
            return [LoRARequest(f"dart-es-member-{i}", i, "in-memory://dart-es") for i in ids], None
        folder = tempfile.mkdtemp(prefix="dart_es_lora_", dir=_shm_dir())
        return [
            LoRARequest(f"dart-es-member-{i}", i, os.path.join(folder, f"dart-es-member-{i}")) for i in ids
        ], folder

    def _add_adapters(self, members: Sequence[Member], requests: Sequence) -> None:
        tensors = [member_adapter_tensors(self.params, m, self._dtype) for m in members]
        if self.handover == "memory":
            adapters = [(r.lora_int_id, t) for r, t in zip(requests, tensors, strict=True)]
            config = self._config
            self.engine.llm.collective_rpc(lambda worker: _add_in_memory(worker, adapters, config))
            return
        from safetensors.torch import save_file

        for request, t in zip(requests, tensors, strict=True):
            os.makedirs(request.lora_path)
            save_file(t, os.path.join(request.lora_path, "adapter_model.safetensors"))
            with open(os.path.join(request.lora_path, "adapter_config.json"), "w") as f:
                json.dump(self._config, f)
            self.engine.llm.llm_engine.add_lora(request)

    def _remove_adapters(self, requests: Sequence, folder: str | None) -> None:
        for request in requests:  # an id that was never added is a no-op
            self.engine.llm.llm_engine.remove_lora(request.lora_int_id)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    # ------------------------------------------------------------------------------------------ public
    def generate_population(
        self,
        prompts: Sequence[Any],
        members: Sequence[Member],
        columns: Sequence[Sequence[int]] | None = None,
    ) -> list[Generation]:
        """One `Generation` per member: the base weights (pushed if the engine lacks them), one adapter per
        member, every member's rows (all prompts, or `columns[n]`) in ONE engine call; the adapters are removed
        on return."""
        if self.params.is_perturbed:
            raise RuntimeError("generate_population() needs the base weights; a member is still applied")
        members = list(members)
        if not members:
            return []
        cols = member_columns(len(prompts), len(members), columns)
        if len(members) > self.max_loras:
            raise ValueError(
                f"{len(members)} members but the engine serves at most {self.max_loras} adapters"
            )
        t0 = time.perf_counter()
        self.sync_weights()  # once per step: after the update the engine needs the new base
        encoded = self._encode(prompts)
        requests, folder = self._adapter_requests(members)
        # Everything from here on is undone on any exception or Ctrl-C: the engine aborts this call's requests
        # (_Engine.generate) and every adapter is removed, so the engine is left as it was before the call.
        try:
            self._add_adapters(members, requests)
            self.last_perturb_time = time.perf_counter() - t0
            rows = [encoded[i] for mine in cols for i in mine]  # member-major
            sampling = [
                sp
                for m, mine in zip(members, cols, strict=True)
                for sp in self._sampling_params(len(mine), m.seed)
            ]
            loras = [r for r, mine in zip(requests, cols, strict=True) for _ in mine]
            outputs = self.engine.generate(rows, sampling, lora_request=loras)
        finally:
            t1 = time.perf_counter()
            self._remove_adapters(requests, folder)
            self.last_perturb_time += time.perf_counter() - t1
        ids = [list(out.outputs[0].token_ids) for out in outputs]
        texts = [self.tokenizer.decode(row, skip_special_tokens=True) for row in ids]
        self._sleep()
        out, start = [], 0
        for mine in cols:
            out.append(
                Generation(texts=texts[start : start + len(mine)], token_ids=ids[start : start + len(mine)])
            )
            start += len(mine)
        return out


# ---------------------------------------------------------------------------------- worker-side helpers
def _expected_lora_modules(worker) -> list[str] | None:
    """The module names (q_proj, ...) the engine's LoRA manager accepts; None without one."""
    runner = getattr(worker, "model_runner", None)
    manager = getattr(runner, "lora_manager", None)
    adapters = getattr(manager, "_adapter_manager", None)
    if adapters is None:
        return None
    packed = adapters.packed_modules_mapping
    out: list[str] = []
    for module in adapters.supported_lora_modules:
        out.extend(packed.get(module, [module]))
    return out


def _add_in_memory(worker, adapters: list[tuple[int, dict[str, torch.Tensor]]], config: dict) -> None:
    """Build each adapter from in-memory tensors and put it in the worker's adapter cache, as vLLM's own
    loader (``LRUCacheWorkerLoRAManager.add_adapter``) does after reading a folder."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    cache = manager._adapter_manager
    helper = PEFTHelper.from_dict(dict(config))
    helper.validate_legal(manager.lora_config)
    model = cache.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapper = mapper.get_rename_mapper() if mapper is not None else None
    for lora_id, tensors in adapters:
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=lora_id,
            tensors=tensors,
            peft_helper=helper,
            device="cpu",
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=mapper,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        cache.remove_adapter(lora_id)
        if len(cache) + 1 > cache.capacity:
            cache.remove_oldest_adapter()
        cache.add_adapter(lora)
