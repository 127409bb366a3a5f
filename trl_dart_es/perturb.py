"""Apply, undo and update seeded ES perturbations on any ``torch.nn.Module``'s trainable parameters.

``EvolvedParameters`` owns the ES arithmetic on weights and nothing else: it does not know about
models, tokenizers or trainers. It walks ``named_parameters()`` (trainable ones only) and rebuilds each
member's noise from ``(seed, parameter name)`` with :func:`trl_dart_es.noise.gaussian`'s definition.

Two modes:

* ``exact_restore=True`` (default, this project's improvement). An fp32 master copy ``base`` of every
  trainable parameter is kept. A member is applied as ``param = (base + sign*sigma*eps).to(dtype)``,
  restore writes ``param = base.to(dtype)`` (bitwise the original weights, in fp32, bf16 and fp16), and
  the update accumulates ``(lr/N) * sum_n z_n sign_n eps_n`` in fp32, adds it to ``base`` and writes each
  parameter once. Costs one fp32 copy of the trainable parameters.
* ``exact_restore=False`` (the paper's reference behaviour, no extra copy). Noise is added and subtracted
  in place in the parameter dtype, and the update is added in place member by member. In 16-bit this
  drifts: ``(x + d) - d != x`` after rounding, so the base moves a little with every member, and update
  increments smaller than half a unit in the last place are lost (in bf16, weights near 1.0 such as norm
  gains barely move). Fine in fp32.

On CPU the work is cut into the noise chunks of :mod:`trl_dart_es.noise` and spread over its thread
pool; drawing a chunk and using it happen back to back, so the noise is still in cache when it is added.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .noise import (
    CHUNK_SIZE,
    NOISE_TYPES,
    Member,
    fill_chunk,
    gaussian,
    iter_chunks,
    parallel_map,
    tensor_seed,
)

__all__ = ["EvolvedParameters"]


@dataclass(frozen=True)
class _Task:
    """A slice of one parameter: a CPU noise chunk, or a whole parameter on other devices."""

    index: int  # parameter index
    chunk: int | None  # CPU noise chunk index; None = whole tensor drawn with gaussian()
    start: int
    stop: int


class _Scratch(threading.local):
    """Per-thread chunk buffers, so workers never allocate in the hot loop."""

    def get(self, slot: str, n: int) -> torch.Tensor:
        buf = getattr(self, slot, None)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, CHUNK_SIZE), dtype=torch.float32)
            setattr(self, slot, buf)
        return buf[:n]


class MemberState:
    """What both parameter sets (full- and low-rank) share: which member is applied, and a scoped apply.

    Subclasses set ``self._names`` and ``self._current`` and implement ``perturb`` and ``restore``.
    """

    _names: list[str]
    _current: Member | None
    momentum: float = 0.0
    _velocity: dict[str, torch.Tensor]

    @property
    def names(self) -> list[str]:
        """Names of the evolved parameters, in ``named_parameters()`` order."""
        return list(self._names)

    @property
    def is_perturbed(self) -> bool:
        return self._current is not None

    @property
    def current_member(self) -> Member | None:
        return self._current

    def perturb(self, member: Member) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def perturbed(self, member: Member) -> Iterator[None]:
        """Apply ``member`` for the duration of the block; restores on exit, exceptions included."""
        try:
            self.perturb(member)
            yield
        finally:
            self.restore()

    def _init_momentum(self, momentum: float, exact_restore: bool) -> None:
        if not (isinstance(momentum, int | float) and 0.0 <= momentum < 1.0):
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if momentum and not exact_restore:
            raise ValueError(
                "momentum needs exact_restore=True: the running update is kept and applied in fp32"
            )
        self.momentum = float(momentum)
        self._velocity = {}

    def _velocity_of(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """The flat fp32 running update of ``param`` (zeros at first). Made before an update's threads start."""
        if name not in self._velocity:
            self._velocity[name] = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
        return self._velocity[name]

    def _with_momentum(self, name: str, start: int, delta: torch.Tensor) -> torch.Tensor:
        """What to apply for ``delta``, the ES update of flat elements ``start:`` of parameter ``name``: ``delta``
        itself, or with momentum its running update ``v <- mu v + (1 - mu) delta``. The (1 - mu) keeps a step
        whose direction repeats as long as plain ES's, and shrinks one that averages noise."""
        if not self.momentum:
            return delta
        v = self._velocity[name][start : start + delta.numel()].view_as(delta)
        return v.mul_(self.momentum).add_(delta, alpha=1.0 - self.momentum)

    def velocity_state_dict(self) -> dict[str, torch.Tensor]:
        """The running updates by parameter name (flat, fp32): empty without momentum or before the first
        update. A checkpoint carries them so that a resumed run continues the same trajectory."""
        return {n: v.detach().cpu() for n, v in self._velocity.items()}

    def load_velocity_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        unknown = sorted(set(state) - set(self._names))
        if unknown:
            raise ValueError(f"velocity state names {unknown[:3]} are not evolved parameters")
        self._velocity = {n: t.to(torch.float32).reshape(-1).clone() for n, t in state.items()}

    def _update_coefficients(
        self, members: Sequence[Member], z: Sequence[float], lr: float
    ) -> tuple[list[Member], dict[int, float]]:
        """Check an update's inputs and restore; return the members as a list and Σ sign·z per seed (antithetic
        pairs combine first)."""
        members = list(members)
        z = [float(v) for v in z]
        if not members:
            raise ValueError("update needs at least one member")
        if len(members) != len(z):
            raise ValueError(f"got {len(members)} members but {len(z)} fitness values")
        if not all(math.isfinite(v) for v in z) or not math.isfinite(lr):
            raise ValueError("z and lr must be finite")
        self.restore()
        coef: dict[int, float] = {}
        for m, zn in zip(members, z, strict=True):
            coef[m.seed] = coef.get(m.seed, 0.0) + m.sign * zn
        return members, coef


class EvolvedParameters(MemberState):
    """The trainable parameters of ``model`` under ES perturbation with noise scale ``sigma``.

    Args:
        model: any module; only parameters with ``requires_grad=True`` are evolved (tied parameters once,
            under their first name).
        sigma: noise scale.
        exact_restore: keep an fp32 master copy for bitwise restore and fp32 updates (see module doc).
        cache_noise: keep every evaluated member's noise until the next :meth:`update`, so the update does
            not draw it again. Costs ``4 * num_parameters`` bytes per distinct seed (antithetic pairs share
            one), i.e. up to ``N * num_parameters * 4`` bytes per step. Results are identical without it.
        noise_type: only ``"gaussian"`` (full rank) for now; the argument leaves room for low-rank noise.
        momentum: mu in [0, 1): apply the running update ``v <- mu v + (1 - mu) delta`` instead of each step's
            ES update ``delta`` (0: the reference update). Needs ``exact_restore``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        sigma: float,
        *,
        exact_restore: bool = True,
        cache_noise: bool = True,
        noise_type: str = "gaussian",
        momentum: float = 0.0,
    ) -> None:
        if not (math.isfinite(sigma) and sigma > 0):
            raise ValueError(f"sigma must be a positive finite number, got {sigma!r}")
        self._init_momentum(momentum, exact_restore)
        if noise_type not in NOISE_TYPES:
            raise ValueError(f"noise_type must be one of {NOISE_TYPES}, got {noise_type!r}")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters (requires_grad=True)")
        for name, param in named:
            if not param.is_contiguous():
                raise ValueError(f"parameter {name!r} is not contiguous; ES writes flat views of parameters")
            if not param.is_floating_point():
                raise ValueError(f"parameter {name!r} has non-floating dtype {param.dtype}")
        self.sigma = float(sigma)
        self.exact_restore = exact_restore
        self.cache_noise = cache_noise
        self.noise_type = noise_type
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._base: list[torch.Tensor] | None = None
        if exact_restore:
            self._base = [p.detach().to(torch.float32, copy=True) for p in self._params]
        self._cache: dict[int, list[torch.Tensor]] = {}
        # Buffers of cleared cache entries, reused by the next step: touching fresh pages of a large
        # allocation costs more than drawing the noise into memory that is already mapped.
        self._spare: list[list[torch.Tensor]] = []
        self._current: Member | None = None
        self._applied: set[tuple[int, int]] = set()  # reference mode: (param, start) slices carrying noise
        self._scratch = _Scratch()
        self._lock = threading.Lock()
        self._tasks = self._build_tasks()

    # ------------------------------------------------------------------------------------------ properties
    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self._params)

    @property
    def cached_seeds(self) -> list[int]:
        return list(self._cache)

    # ----------------------------------------------------------------------------------------- internals
    def _build_tasks(self) -> list[_Task]:
        tasks = []
        for i, p in enumerate(self._params):
            if p.device.type == "cpu":
                tasks.extend(_Task(i, c, s, e) for c, s, e in iter_chunks(p.numel()))
            else:
                tasks.append(_Task(i, None, 0, p.numel()))
        # Biggest first keeps both threads busy until the end.
        tasks.sort(key=lambda t: t.start - t.stop)
        return tasks

    def _run(self, fn) -> list:
        cpu = [t for t in self._tasks if t.chunk is not None]
        other = [t for t in self._tasks if t.chunk is None]
        return parallel_map(fn, cpu) + [fn(t) for t in other]

    def _flat(self, i: int) -> torch.Tensor:
        return self._params[i].detach().view(-1)  # not .data: writes must bump the version (weight sync)

    def _eps(self, seed: int, t: _Task, slot: str, fresh: dict[int, list[torch.Tensor]] | None = None):
        """Noise of ``seed`` on task ``t``: from the cache, else drawn (into ``fresh`` when caching)."""
        cached = self._cache.get(seed)
        if cached is not None:
            return cached[t.index].view(-1)[t.start : t.stop]
        if fresh is not None and seed in fresh:
            out = fresh[seed][t.index].view(-1)[t.start : t.stop]
        elif t.chunk is not None:
            out = self._scratch.get(slot, t.stop - t.start)
        else:
            out = torch.empty(t.stop - t.start, dtype=torch.float32, device=self._params[t.index].device)
        if t.chunk is not None:
            return fill_chunk(tensor_seed(seed, self._names[t.index]), t.chunk, out)
        return gaussian(seed, self._names[t.index], (t.stop - t.start,), device=out.device, out=out)

    # ------------------------------------------------------------------------------------------ public API
    def perturb(self, member: Member) -> None:
        """Set the parameters to ``theta + member.sign * sigma * eps(member.seed)``.

        May be called while another member is applied (it replaces it; no restore needed in between).
        """
        if not isinstance(member, Member):
            raise TypeError(f"perturb expects a Member, got {type(member).__name__}")
        if not self.exact_restore and self._current is not None:
            self.restore()
        fresh = None
        if self.cache_noise and member.seed not in self._cache:
            bufs = (
                self._spare.pop()
                if self._spare
                else [torch.empty_like(p, dtype=torch.float32) for p in self._params]
            )
            fresh = {member.seed: bufs}
        alpha = member.sign * self.sigma
        # Mark first: if this is interrupted, restore() still knows the weights may be dirty.
        self._current = member

        if self.exact_restore:
            base = self._base

            def apply(t: _Task) -> None:
                eps = self._eps(member.seed, t, "eps", fresh)
                b = base[t.index].view(-1)[t.start : t.stop]
                dst = self._flat(t.index)[t.start : t.stop]
                if dst.dtype == torch.float32:
                    torch.add(b, eps, alpha=alpha, out=dst)
                else:
                    dst.copy_(torch.add(b, eps, alpha=alpha, out=self._scratch.get("tmp", t.stop - t.start)))

        else:

            def apply(t: _Task) -> None:
                eps = self._eps(member.seed, t, "eps", fresh)
                dst = self._flat(t.index)[t.start : t.stop]
                # Reference behaviour: the noise is rounded to the parameter dtype and added in place.
                dst.add_((eps * alpha).to(dst.dtype))
                with self._lock:
                    self._applied.add((t.index, t.start))

        try:
            self._run(apply)
        except BaseException:
            if fresh is not None:  # half-filled: not a valid cache entry, but still a reusable buffer
                self._spare.append(bufs)
            raise
        if fresh is not None:
            self._cache.update(fresh)

    def restore(self) -> None:
        """Put the unperturbed parameters back (bitwise, with ``exact_restore``). No-op if none applied."""
        if self._current is None:
            return
        if self.exact_restore:
            for p, b in zip(self._params, self._base, strict=True):
                p.detach().copy_(b)
        else:
            member = self._current
            alpha = member.sign * self.sigma
            applied = set(self._applied)

            def undo(t: _Task) -> None:
                if (t.index, t.start) not in applied:
                    return
                eps = self._eps(member.seed, t, "eps")
                dst = self._flat(t.index)[t.start : t.stop]
                dst.sub_((eps * alpha).to(dst.dtype))

            self._run(undo)
            self._applied.clear()
        self._current = None

    def update(self, members: Sequence[Member], z: Sequence[float], lr: float) -> float:
        """``theta += (lr / N) * sum_n z[n] * members[n].sign * eps(members[n].seed)``.

        The sum is accumulated in fp32 per element (members sharing a seed are combined first). Restores
        first if a member is applied, uses cached noise where available and draws the rest, then clears
        the cache. Returns the L2 norm of the fp32 update applied (over all parameters; with momentum, of the
        running update).
        """
        members, coef = self._update_coefficients(members, z, lr)
        scale = float(lr) / len(members)
        groups = [(seed, c * scale) for seed, c in coef.items() if c != 0.0]

        def step(t: _Task) -> float:
            n = t.stop - t.start
            if t.chunk is not None:
                acc = self._scratch.get("acc", n).zero_()
            else:
                acc = torch.zeros(n, dtype=torch.float32, device=self._params[t.index].device)
            dst = self._flat(t.index)[t.start : t.stop]
            for seed, c in groups:
                eps = self._eps(seed, t, "eps")
                acc.add_(eps, alpha=c)
                if not self.exact_restore:
                    # Reference behaviour: each increment is rounded into the parameter dtype on its own.
                    dst.add_((eps * c).to(dst.dtype))
            if self.exact_restore:
                acc = self._with_momentum(self._names[t.index], t.start, acc)
                b = self._base[t.index].view(-1)[t.start : t.stop]
                b.add_(acc)
                dst.copy_(b)
            return float(torch.dot(acc, acc))

        if self.momentum:
            for name, param in zip(self._names, self._params, strict=True):
                self._velocity_of(name, param)
        try:
            sq = self._run(step)
        finally:
            self.clear_cache()
        return math.sqrt(sum(sq))

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights by parameter name, when they hold more than the model does.

        Empty unless ``exact_restore`` is on and some evolved parameter is stored below fp32: then the saved
        model alone would lose the master's precision, so a checkpoint should carry these too.
        """
        if not self.exact_restore or all(p.dtype == torch.float32 for p in self._params):
            return {}
        return {n: b.detach().cpu() for n, b in zip(self._names, self._base, strict=True)}

    def load_master_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load fp32 master weights saved by :meth:`master_state_dict` and write them into the model."""
        if not self.exact_restore:
            raise RuntimeError("load_master_state_dict needs exact_restore=True")
        check_master_names(self._names, state)
        self.restore()
        load_master_into(self._names, self._params, self._base, state)
        self.clear_cache()

    def clear_cache(self, free_memory: bool = False) -> None:
        """Forget cached noise (``update`` does this itself).

        The buffers are kept for the next step's members unless ``free_memory=True``.
        """
        if free_memory:
            self._spare.clear()
        else:
            self._spare.extend(self._cache.values())
        self._cache.clear()

    def sync_from_model(self) -> None:
        """Re-read the base point from the model's current weights (e.g. after loading a checkpoint)."""
        if self.exact_restore:
            for p, b in zip(self._params, self._base, strict=True):
                b.copy_(p.detach())
        self._current = None
        self._applied.clear()
        self.clear_cache()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_tensors={len(self._params)}, num_parameters={self.num_parameters:,}, "
            f"sigma={self.sigma}, exact_restore={self.exact_restore}, cache_noise={self.cache_noise})"
        )


def check_master_names(names: Sequence[str], state: dict[str, torch.Tensor]) -> None:
    """Raise a ValueError naming what differs between saved master weights and the evolved parameters."""
    missing = [n for n in names if n not in state]
    unexpected = [n for n in state if n not in set(names)]
    if missing or unexpected:
        raise ValueError(
            f"master weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def load_master_into(
    names: Sequence[str],
    params: Sequence[torch.Tensor],
    bases: Sequence[torch.Tensor],
    state: dict[str, torch.Tensor],
) -> None:
    """Copy saved fp32 masters into `bases` and write them into the parameters (shapes checked by name)."""
    for name, p, b in zip(names, params, bases, strict=True):
        src = state[name]
        if tuple(src.shape) != tuple(b.shape):
            raise ValueError(
                f"master weight {name!r} has shape {tuple(src.shape)}, expected {tuple(b.shape)}"
            )
        b.copy_(src)
        p.detach().copy_(b)
