"""Splitting the ES population over processes (and machines) without ever sending weights.

Every process holds a full replica of the model, evaluates its share of the members, and the rewards are
gathered so that every process can run the same `tell` and rebuild the same update from the members' seeds.
This module holds the pieces that make that safe:

* :func:`gather_object_with_timeout`: an all-gather that ends with a clear error, not a hang, when a peer
  has crashed, was killed or is stuck. It runs on its own gloo group whose timeout is the one asked for
  (`TrainingArguments.ddp_timeout`), which the process group that Accelerate creates on CPU ignores.
* :func:`check_distributed_setup`: refuses set-ups that cannot work for ES (DeepSpeed, FSDP) and catches
  the silent one where `torch.distributed` has several processes but Accelerate sees one.
"""

from __future__ import annotations

import itertools
import os
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["GatherError", "check_distributed_setup", "check_not_sharded", "gather_object_with_timeout"]

_KEY_PREFIX = "trl_dart_es/gather"
_groups: dict[tuple[float, int], Any] = {}
_calls = itertools.count()
_last_mark: str | None = None  # this rank's arrival mark of its last successful gather


class GatherError(RuntimeError):
    """A gather across processes failed or timed out; the message names the ranks that never arrived."""


def _is_multi_process() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _group(timeout: float):
    # A gloo group of all ranks with our timeout. Creating it is itself a collective: every rank reaches the
    # first gather at the same point, so every rank creates it there.
    key = (timeout, id(dist.group.WORLD))  # a new default group (re-initialised) needs a new group too
    if key not in _groups:
        _groups[key] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    return _groups[key]


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # private API: diagnostics only, never needed for the gather itself
        return None


def gather_object_with_timeout(obj: Any, *, timeout: float, what: str = "gather") -> list[Any]:
    """`obj` of every process, in rank order, on every process; at most `timeout` seconds of waiting.

    Picklable objects only (as `torch.distributed.all_gather_object`). With one process, returns `[obj]`.

    Raises:
        GatherError: a peer did not arrive within `timeout` seconds, or its connection closed (it crashed or
            was killed). The message starts with `what` and names the ranks that never reached the gather.
    """
    global _last_mark
    if not _is_multi_process():
        return [obj]
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    rank, world = dist.get_rank(), dist.get_world_size()
    call = next(_calls)
    store = _store()
    arrived_key = f"{_KEY_PREFIX}/{call}/{{}}"
    if store is not None:  # an arrival mark per rank, so that a failure can say who never came
        store.set(arrived_key.format(rank), "1")
    out: list[Any] = [None] * world
    start = time.monotonic()
    try:
        dist.all_gather_object(out, obj, group=_group(float(timeout)))
    except Exception as err:
        waited = time.monotonic() - start
        missing = _missing_ranks(store, arrived_key, world)
        if missing is None:
            who = "could not tell which ranks are missing"
        elif missing:
            ranks = ("rank " if len(missing) == 1 else "ranks ") + ", ".join(str(r) for r in missing)
            who = (
                f"{ranks} never reached it: crashed, killed or stuck (see that process's log; if its steps "
                "are only slow, raise `ddp_timeout`)"
            )
        else:
            who = "every rank reached it, so a peer failed during the exchange"
        raise GatherError(
            f"{what}: gathering from {world} processes failed on rank {rank} after {waited:.1f} s "
            f"(timeout {timeout:g} s, `ddp_timeout`); {who}. Cause: {type(err).__name__}: {err}"
        ) from err
    if store is not None:
        # Everyone arrived here, so everyone is done with the previous gather: its mark will not be read again.
        # (This gather's mark stays until the next one: a peer may still be failing inside this one.)
        if _last_mark is not None:
            try:
                store.delete_key(_last_mark)
            except Exception:
                pass
        _last_mark = arrived_key.format(rank)
    return out


def _missing_ranks(store, key: str, world: int) -> list[int] | None:
    if store is None:
        return None
    try:
        return [r for r in range(world) if not store.check([key.format(r)])]
    except Exception:  # the store went away with its host process
        return None


_SHARDED = {
    "DEEPSPEED": "DeepSpeed",
    "FSDP": "FSDP",
    "MEGATRON_LM": "Megatron-LM",
}


def check_not_sharded(args: Any) -> None:
    """Refuse DeepSpeed, FSDP and Megatron-LM, with a message that says what to use instead.

    Looks only at `args.deepspeed`, `args.fsdp`, an already set-up `args.distributed_state` and the variables
    `accelerate launch` sets, so it can run before `TrainingArguments.__post_init__` (which, under DeepSpeed,
    fails first if the optional `deepspeed` package is missing).

    Raises:
        ValueError: DeepSpeed, FSDP or Megatron-LM is configured. ES needs the whole model in every process,
            because every process generates with its own perturbed replica; sharding parameters would mean
            gathering them for every member's generation.
    """
    state = getattr(args, "distributed_state", None)
    dtype = getattr(getattr(state, "distributed_type", None), "name", "")
    sharded = None
    if getattr(args, "deepspeed", None) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        sharded = "DeepSpeed"
    elif getattr(args, "fsdp", None) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        sharded = "FSDP"
    elif dtype in _SHARDED:
        sharded = _SHARDED[dtype]
    if sharded:
        raise ValueError(
            f"DartESTrainer does not run under {sharded}. Evolution strategies need the whole model in every "
            "process: each process generates with its own perturbed copy, and only seeds and rewards cross "
            "processes, so there are no gradients or optimizer states to shard. Launch plain data-parallel "
            "replicas instead, e.g. `accelerate launch --config_file recipes/accelerate_configs/multi_gpu.yaml "
            "...` (or --multi_gpu --num_processes N). For a model too big for one device, use LoRA "
            "(peft_config) or a vLLM engine with tensor parallelism (use_vllm, vllm_tensor_parallel_size). "
            "See docs/scaling.md."
        )


def check_distributed_setup(args: Any) -> None:
    """Refuse what the ES trainer cannot do, with a message that says what to use instead.

    Args:
        args: the trainer's `TrainingArguments` (its `distributed_state` is set up on first access of
            `args.device`).

    Raises:
        ValueError: see :func:`check_not_sharded`.
        RuntimeError: `torch.distributed` runs several processes but Accelerate sees one, as on a machine
            without GPUs started with `accelerate launch --multi_gpu` but without `use_cpu=True`: every
            process would run the whole population on its own.
    """
    check_not_sharded(args)
    _ = args.device  # sets up args.distributed_state
    check_not_sharded(args)  # now with the distributed type Accelerate settled on
    if _is_multi_process():
        seen = getattr(getattr(args, "distributed_state", None), "num_processes", 1)
        if seen != dist.get_world_size():
            raise RuntimeError(
                f"torch.distributed runs {dist.get_world_size()} processes but Accelerate sees {seen}: every "
                "process would evaluate the whole population on its own. On a machine without GPUs, set "
                "`use_cpu=True` (`--use_cpu true` on the command line) and launch with `accelerate launch "
                "--multi_gpu --num_processes N` or recipes/accelerate_configs/cpu_2proc.yaml."
            )
