"""Seeded Gaussian noise for evolution strategies.

A member of the population is nothing but a seed (and, for antithetic sampling, a sign). Its noise
``eps`` over the model is rebuilt on demand, tensor by tensor, from ``(seed, parameter name)``, so only
seeds and rewards ever need to cross processes.

How a tensor's noise is defined (this is the contract every process relies on):

* ``tensor_seed(seed, name)`` hashes the member seed and the parameter name with BLAKE2b. Different
  tensors get unrelated streams even when they have the same shape (earlier ES code seeded every tensor
  with the same seed, so all same-shaped tensors got the same noise), and the result does not depend on
  the order in which tensors are visited.
* On CPU the flattened tensor is cut into fixed chunks of ``CHUNK_SIZE`` elements. Chunk ``i`` is filled
  by ``Tensor.normal_`` from a ``torch.Generator`` seeded with ``chunk_seed(tensor_seed, i)``. Chunks are
  independent sub-streams, so they can be drawn by several threads at once and the values never depend
  on the number of threads. This is the fastest exact Gaussian we measured on the project's CPU (see
  docs/method.md and results/es_bookkeeping.md): torch's vectorised Box-Muller at ~2.4 ns/element on
  one thread, ~1.3 ns/element over two threads, against ~7-9 ns/element for numpy's ziggurat
  (PCG64, SFC64, Philox) and ~3.9 ns/element for a per-tensor ``torch.randn`` that allocates.
* On CUDA a tensor is drawn in one go from a CUDA ``torch.Generator`` seeded with ``tensor_seed``.

Noise is bitwise identical across processes on the same device type and torch build. It is *not* the
same on CPU and on CUDA (different generators), so all processes of one run must draw on the same
device type.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "CHUNK_SIZE",
    "NOISE_TYPES",
    "Member",
    "chunk_seed",
    "derive_step_seed",
    "fill_chunk",
    "gaussian",
    "get_num_threads",
    "iter_chunks",
    "parallel_map",
    "population",
    "set_num_threads",
    "tensor_seed",
]

# Part of the noise definition: changing it changes every member's noise on CPU.
# 2**18 float32 = 1 MiB: large enough to amortise seeding, small enough to stay in cache.
CHUNK_SIZE = 1 << 18

# Room for structured noise (e.g. EGGROLL-style low rank). Only full-rank Gaussian exists today.
NOISE_TYPES = ("gaussian",)

_SEED_MASK = (1 << 63) - 1


@dataclass(frozen=True)
class Member:
    """One member of the population: a noise seed and a sign (antithetic pairs share the seed)."""

    seed: int
    sign: int = 1

    def __post_init__(self) -> None:
        if self.sign not in (1, -1):
            raise ValueError(f"Member.sign must be +1 or -1, got {self.sign!r}")
        if not 0 <= int(self.seed) <= _SEED_MASK:
            raise ValueError(f"Member.seed must be in [0, 2**63), got {self.seed!r}")


def derive_step_seed(seed: int, step: int) -> int:
    """A 63-bit seed for ES step ``step`` of a run seeded with ``seed``."""
    if seed < 0 or step < 0:
        raise ValueError(f"seed and step must be >= 0, got seed={seed}, step={step}")
    state = np.random.SeedSequence([int(seed), int(step)]).generate_state(1, dtype=np.uint64)
    return int(state[0]) & _SEED_MASK


def population(step_seed: int, size: int, antithetic: bool = False) -> list[Member]:
    """``size`` members with distinct seeds derived deterministically from ``step_seed``.

    With ``antithetic=True`` the members come in pairs ``(+eps, -eps)`` that share a seed, so ``size``
    must be even.
    """
    if not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"population size must be a positive integer, got {size!r}")
    if antithetic and size % 2:
        raise ValueError(f"antithetic sampling needs an even population size, got {size}")
    if step_seed < 0:
        raise ValueError(f"step_seed must be >= 0, got {step_seed}")
    num_seeds = size // 2 if antithetic else size
    # A few spare words cover the (astronomically unlikely) case of two equal 63-bit seeds.
    words = np.random.SeedSequence(int(step_seed)).generate_state(num_seeds + 8, dtype=np.uint64)
    seeds = list(dict.fromkeys(int(w) & _SEED_MASK for w in words))[:num_seeds]
    if len(seeds) < num_seeds:  # pragma: no cover - would need 9 collisions among 63-bit hashes
        raise RuntimeError(f"could not derive {num_seeds} distinct seeds from step_seed={step_seed}")
    if antithetic:
        return [Member(s, sign) for s in seeds for sign in (1, -1)]
    return [Member(s) for s in seeds]


def _blake63(person: bytes, payload: bytes) -> int:
    digest = hashlib.blake2b(payload, digest_size=8, person=person).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


def tensor_seed(seed: int, name: str) -> int:
    """Stable 63-bit seed for member ``seed``'s noise on parameter ``name`` (BLAKE2b, not ``hash()``)."""
    return _blake63(b"dart-es/tensor", int(seed).to_bytes(8, "little", signed=False) + name.encode("utf-8"))


def chunk_seed(tseed: int, index: int) -> int:
    """Seed of chunk ``index`` of a tensor whose ``tensor_seed`` is ``tseed`` (CPU only)."""
    return _blake63(b"dart-es/chunk", int(tseed).to_bytes(8, "little") + int(index).to_bytes(8, "little"))


def iter_chunks(numel: int) -> Iterable[tuple[int, int, int]]:
    """``(index, start, stop)`` of the fixed chunks covering a flattened tensor of ``numel`` elements."""
    for index, start in enumerate(range(0, numel, CHUNK_SIZE)):
        yield index, start, min(start + CHUNK_SIZE, numel)


def fill_chunk(tseed: int, index: int, out: torch.Tensor) -> torch.Tensor:
    """Fill the 1-D float32 CPU view ``out`` with chunk ``index`` of the tensor seeded ``tseed``."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(chunk_seed(tseed, index))
    return out.normal_(generator=gen)


# ----------------------------------------------------------------------------------------------- threads
_num_threads: int | None = None
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def get_num_threads() -> int:
    """Threads used to draw CPU noise (default: ``torch.get_num_threads()``). Never changes the values."""
    return _num_threads if _num_threads is not None else max(1, torch.get_num_threads())


def set_num_threads(num_threads: int | None) -> None:
    """Set the number of noise threads (``None``: follow ``torch.get_num_threads()``)."""
    global _num_threads, _pool
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    with _pool_lock:
        _num_threads = num_threads
        if _pool is not None:
            _pool.shutdown(wait=True)
            _pool = None


def parallel_map(fn: Callable, items: Sequence) -> list:
    """``[fn(x) for x in items]`` over the noise thread pool (torch kernels release the GIL)."""
    global _pool, _pool_size
    threads = get_num_threads()
    if threads == 1 or len(items) < 2:
        return [fn(x) for x in items]
    with _pool_lock:
        if _pool is None or _pool_size != threads:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dart-es-noise")
            _pool_size = threads
        pool = _pool
    futures = [pool.submit(fn, x) for x in items]
    try:
        return [f.result() for f in futures]
    except BaseException:
        # Never return (e.g. on KeyboardInterrupt) while workers still write into tensors: a caller's
        # restore() would race with them.
        for f in futures:
            f.cancel()
        wait(futures)
        raise


def _reset_pool_after_fork() -> None:
    # A forked child must not reuse the parent's worker threads (they do not exist in the child).
    global _pool
    _pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_pool_after_fork)


# -------------------------------------------------------------------------------------------------- draw
def _as_shape(shape) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        return (int(shape),)
    return tuple(int(s) for s in shape)


def gaussian(
    seed: int,
    name: str,
    shape,
    *,
    device: str | torch.device = "cpu",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float32 N(0, 1) noise of member ``seed`` for parameter ``name``.

    A deterministic function of ``(seed, name, shape)`` and the device type: independent across tensors,
    independent of the order tensors are drawn in, identical across processes. With ``out`` (a contiguous
    float32 tensor of ``shape``) the values are written there and no memory is allocated.
    """
    shape = _as_shape(shape)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=device)
    else:
        if out.dtype != torch.float32 or tuple(out.shape) != shape or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous float32 tensor of shape {shape}, "
                f"got {out.dtype} of shape {tuple(out.shape)} (contiguous={out.is_contiguous()})"
            )
    tseed = tensor_seed(seed, name)
    if out.device.type == "cuda":
        gen = torch.Generator(device=out.device)
        gen.manual_seed(tseed)
        return out.normal_(generator=gen)
    if out.device.type != "cpu":  # e.g. mps: draw with the CPU definition and copy over
        out.copy_(gaussian(seed, name, shape, device="cpu"))
        return out
    flat = out.view(-1)
    parallel_map(lambda c: fill_chunk(tseed, c[0], flat[c[1] : c[2]]), list(iter_chunks(flat.numel())))
    return out
