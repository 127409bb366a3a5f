"""Low-rank ES perturbations (EGGROLL, arXiv:2511.16652) and the batched population forward they allow.

Member ``n`` perturbs every 2-D trainable parameter ``W`` (``m x n``: linear weights as ``(out, in)``,
embedding tables as ``(vocab, dim)``) by ``sign_n * sigma * A_n @ B_n.T / sqrt(r)`` with ``A_n`` (``m x r``)
and ``B_n`` (``n x r``) standard Gaussian. Each entry of ``A_n B_n^T / sqrt(r)`` has variance 1, as in
full-rank ES, so the same ``sigma`` means the same per-weight perturbation size. Every other trainable tensor
(norm gains, biases) keeps full-rank noise, exactly as :class:`~trl_dart_es.perturb.EvolvedParameters` draws
it.

The factors are a deterministic function of ``(member seed, parameter name)``: they are the float32 tensor
``gaussian(seed, name, (r, m + n))`` of :mod:`trl_dart_es.noise`, whose first ``m`` columns are ``A^T`` and
last ``n`` columns ``B^T``. So, as in full rank, only seeds and rewards need to cross processes.

Tied weights (SmolLM2 ties ``lm_head`` to the token embedding) are one parameter under its first name
(``model.embed_tokens.weight``), so they get ONE low-rank perturbation, used consistently at the lookup
(``E[tok] + c * A[tok] @ B^T``) and at the tied output projection (``h E^T + c * (h B) A^T``).

Because members share the base weights, :meth:`LowRankParameters.batched` runs a whole population in one
forward pass: rows are laid out member-major (rows ``[g*k, (g+1)*k)`` belong to the ``g``-th member) and
forward hooks add each member's term to the shared output, ``x W^T + c_g * (x B_g) A_g^T``, with one
batched matmul per layer, whatever the population size. No copy of the weights is ever made.

The update ``theta += (lr/N) sum_n z_n sign_n A_n B_n^T / sqrt(r)`` is one matmul per matrix on the stacked
factors, ``(A diag(c)) B^T``, accumulated in float32 into an fp32 master copy (``exact_restore=True``), so
restore after :meth:`LowRankParameters.perturb` is bitwise exact and 16-bit models keep small updates. An fp32
matrix gets its master copy only when a member is first materialised: the batched and vLLM rollouts never do,
and until then the matrix itself is its exact master (saves one fp32 copy of the evolved weights).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Collection, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .noise import Member, gaussian
from .perturb import EvolvedParameters, MemberState, check_master_names, load_master_into

__all__ = ["LowRankParameters", "lora_carried_names", "select_by_module"]

# Rows of a matrix update computed per matmul: bounds the float32 temporary (16 Mi elements = 64 MiB).
_UPDATE_BLOCK_ELEMENTS = 1 << 24


class _Subset:
    """Looks like a module to EvolvedParameters, which only calls ``named_parameters()``."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]):
        self._named = named

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self._named)


class LowRankParameters(MemberState):
    """The trainable parameters of ``model`` under rank-``rank`` ES perturbations with noise scale ``sigma``.

    Same public interface as :class:`~trl_dart_es.perturb.EvolvedParameters` (``perturb``, ``restore``,
    ``perturbed``, ``update``, checkpoints), plus :meth:`factors` and :meth:`batched` for population batching.

    Args:
        model: any module; parameters with ``requires_grad=True`` are evolved (tied ones once). 2-D parameters
            get low-rank noise, all others full-rank noise.
        sigma: noise scale.
        rank: rank ``r`` of the matrix perturbations.
        exact_restore: keep an fp32 master copy: bitwise restore after :meth:`perturb`, fp32 updates (an fp32
            matrix is copied only at the first :meth:`perturb`). False adds and subtracts in place in the
            parameter dtype (the paper's reference behaviour).
        cache_noise: cache the full-rank noise of the non-matrix parameters between evaluation and update (see
            EvolvedParameters). The low-rank factors are always cached until the update: they are small,
            ``4 * r * sum(m + n)`` bytes per member.
        names: evolve only these trainable parameters (e.g. :func:`lora_carried_names`); the others stay
            fixed: neither perturbed nor updated. Default: every trainable parameter. A parameter's factors
            depend only on the seed and its name, so restricting the set does not change the others' noise.
        momentum: as in EvolvedParameters: apply the running update ``v <- mu v + (1 - mu) delta`` (fp32, one
            per evolved parameter; the low-rank steps' sum is high-rank, so ``v`` is a full matrix).
    """

    def __init__(
        self,
        model: nn.Module,
        sigma: float,
        rank: int = 1,
        *,
        exact_restore: bool = True,
        cache_noise: bool = True,
        names: Collection[str] | None = None,
        momentum: float = 0.0,
    ) -> None:
        if not (math.isfinite(sigma) and sigma > 0):
            raise ValueError(f"sigma must be a positive finite number, got {sigma!r}")
        self._init_momentum(momentum, exact_restore)
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be a positive integer, got {rank!r}")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters (requires_grad=True)")
        if names is not None:
            wanted = set(names)
            unknown = sorted(wanted - {n for n, _ in named})
            if unknown:
                raise ValueError(f"names {unknown[:5]} are not trainable parameters of the model")
            named = [(n, p) for n, p in named if n in wanted]
            if not named:
                # lora_carried_names() is empty for a model without nn.Linear layers (GPT-2's are Conv1D).
                raise ValueError(
                    f"{type(model).__name__}: names selects no parameter to evolve (lowrank_targets='lora', "
                    "the default with use_vllm=True, evolves the weights of nn.Linear layers; this model may have "
                    "none). perturbation='full' runs it on either backend"
                )
        for name, param in named:
            if not param.is_floating_point():
                raise ValueError(f"parameter {name!r} has non-floating dtype {param.dtype}")
        self.model = model
        self.sigma = float(sigma)
        self.rank = rank
        self.exact_restore = exact_restore
        self.cache_noise = cache_noise
        self._names = [n for n, _ in named]
        mats = [(n, p) for n, p in named if p.dim() == 2]
        vecs = [(n, p) for n, p in named if p.dim() != 2]
        self._mat_names = [n for n, _ in mats]
        self._mats = [p for _, p in mats]
        # fp32 matrices: None until the first perturb() (the unperturbed matrix is its own exact master).
        self._mat_base: list[torch.Tensor | None] | None = (
            [None if p.dtype == torch.float32 else p.detach().to(torch.float32) for p in self._mats]
            if exact_restore
            else None
        )
        self._vec_names = [n for n, _ in vecs]
        self._vectors = (
            EvolvedParameters(
                _Subset(vecs), sigma, exact_restore=exact_restore, cache_noise=cache_noise, momentum=momentum
            )
            if vecs
            else None
        )
        self._factor_cache: dict[int, list[torch.Tensor]] = {}
        self._current: Member | None = None
        self._applied: set[int] = set()  # reference mode: matrices currently carrying the noise
        self._in_batched = False

    # ------------------------------------------------------------------------------------------ properties
    @property
    def lowrank_names(self) -> list[str]:
        """Names of the parameters with low-rank noise (the 2-D ones)."""
        return list(self._mat_names)

    @property
    def fullrank_names(self) -> list[str]:
        """Names of the parameters with full-rank noise (norm gains, biases, ...)."""
        return list(self._vec_names)

    @property
    def num_parameters(self) -> int:
        vec = self._vectors.num_parameters if self._vectors is not None else 0
        return sum(p.numel() for p in self._mats) + vec

    # ---------------------------------------------------------------------------------------------- noise
    def _member_factors(self, seed: int) -> list[torch.Tensor]:
        """``X`` of shape ``(r, m + n)`` for every matrix: ``A^T = X[:, :m]``, ``B^T = X[:, m:]``."""
        cached = self._factor_cache.get(seed)
        if cached is not None:
            return cached
        out = [
            gaussian(seed, name, (self.rank, p.shape[0] + p.shape[1]), device=p.device)
            for name, p in zip(self._mat_names, self._mats, strict=True)
        ]
        self._factor_cache[seed] = out
        return out

    def factors(self, member: Member | int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, B)`` of member ``member`` (or a seed) for matrix ``name``: float32, ``m x r`` and ``n x r``.

        The sign and scale are not applied: the perturbation is ``sign * sigma * A @ B.T / sqrt(r)``.
        """
        seed = member.seed if isinstance(member, Member) else int(member)
        if name not in self._mat_names:
            raise KeyError(f"{name!r} is not a low-rank (2-D trainable) parameter")
        i = self._mat_names.index(name)
        x = self._member_factors(seed)[i]
        m = self._mats[i].shape[0]
        return x[:, :m].T, x[:, m:].T

    def _delta(self, i: int, seed: int, coef: float) -> torch.Tensor:
        """``coef * A B^T`` in float32 for matrix ``i`` (``coef`` includes sign, sigma and 1/sqrt(r))."""
        x = self._member_factors(seed)[i]
        m = self._mats[i].shape[0]
        return (x[:, :m].T * coef) @ x[:, m:]

    def _masters(self) -> list[torch.Tensor]:
        """Every matrix's fp32 master, copying the fp32 matrices that have none yet (they must be unperturbed)."""
        assert self._mat_base is not None
        for i, p in enumerate(self._mats):
            if self._mat_base[i] is None:
                self._mat_base[i] = p.detach().clone()
        return self._mat_base  # type: ignore[return-value]

    def _master_views(self) -> list[torch.Tensor]:
        """Every matrix's fp32 master without making one: its copy, or the matrix itself when it has none."""
        assert self._mat_base is not None
        return [p.detach() if b is None else b for p, b in zip(self._mats, self._mat_base, strict=True)]

    # ------------------------------------------------------------------------------------------ public API
    def perturb(self, member: Member) -> None:
        """Materialise ``theta + sign * sigma * eps(member)`` in the model's weights.

        The batched rollout never needs this (see :meth:`batched`); it is for evaluating one member alone and
        for checking the batched path. May replace another applied member without a restore in between.
        """
        if not isinstance(member, Member):
            raise TypeError(f"perturb expects a Member, got {type(member).__name__}")
        if self._in_batched:
            raise RuntimeError("cannot materialise a member inside batched(): the hooks assume base weights")
        if not self.exact_restore and self._current is not None:
            self.restore()
        coef = member.sign * self.sigma / math.sqrt(self.rank)
        bases = self._masters() if self.exact_restore else None  # before any weight moves
        self._current = member  # first: if interrupted, restore() still knows the weights may be dirty
        for i, p in enumerate(self._mats):
            delta = self._delta(i, member.seed, coef)
            if bases is not None:
                if p.dtype == torch.float32:
                    torch.add(bases[i], delta, out=p.detach())
                else:
                    p.detach().copy_(bases[i] + delta)
            else:
                p.detach().add_(delta.to(p.dtype))
                self._applied.add(i)
        if self._vectors is not None:
            self._vectors.perturb(member)

    def restore(self) -> None:
        """Put the unperturbed parameters back (bitwise, with ``exact_restore``). No-op if none applied."""
        if self._current is None:
            return
        member = self._current
        if self.exact_restore:
            for p, b in zip(self._mats, self._mat_base, strict=True):  # all exist: perturb() made them
                p.detach().copy_(b)
        else:
            coef = member.sign * self.sigma / math.sqrt(self.rank)
            for i in sorted(self._applied):
                p = self._mats[i]
                p.detach().sub_(self._delta(i, member.seed, coef).to(p.dtype))
            self._applied.clear()
        if self._vectors is not None:
            self._vectors.restore()
        self._current = None

    def update(self, members: Sequence[Member], z: Sequence[float], lr: float) -> float:
        """``theta += (lr / N) * sum_n z[n] * sign_n * eps_n``, with ``eps_n = A_n B_n^T / sqrt(r)`` on matrices.

        Per matrix this is one matmul ``(A diag(c)) B^T`` over the stacked factors of all members (members that
        share a seed are combined first), accumulated in float32 and applied once (with momentum, through the
        running update). Full-rank tensors are updated by EvolvedParameters. Restores first if a member is
        applied; clears the caches. Returns the L2 norm of the float32 update applied over all parameters.
        """
        members, coef = self._update_coefficients(members, z, lr)
        scale = float(lr) / len(members) / math.sqrt(self.rank)
        groups = [(seed, c * scale) for seed, c in coef.items() if c != 0.0]
        sq = 0.0
        try:
            if groups or self.momentum:  # with momentum, a step whose coefficients cancel still moves by mu v
                for i, p in enumerate(self._mats):
                    m = p.shape[0]
                    device = p.device
                    if groups:  # (G*r, m+n)
                        stacked = torch.cat([self._member_factors(seed)[i] for seed, _ in groups])
                    else:
                        stacked = torch.zeros(self.rank, m + p.shape[1], device=device)
                    c = torch.tensor([c for _, c in groups] or [0.0], dtype=torch.float32, device=device)
                    a = stacked[:, :m] * c.repeat_interleave(self.rank)[:, None]  # (A diag(c))^T: (G*r, m)
                    b = stacked[:, m:]  # B^T: (G*r, n)
                    rows = max(1, _UPDATE_BLOCK_ELEMENTS // max(1, p.shape[1]))
                    master = self._mat_base[i] if self.exact_restore else None
                    if self.momentum:
                        self._velocity_of(self._mat_names[i], p)
                    for start in range(0, m, rows):
                        stop = min(start + rows, m)
                        delta = a[:, start:stop].T @ b  # one matmul, float32
                        delta = self._with_momentum(self._mat_names[i], start * p.shape[1], delta)
                        sq += float(torch.dot(delta.reshape(-1), delta.reshape(-1)))
                        if master is not None:
                            base = master[start:stop]
                            base.add_(delta)
                            p.detach()[start:stop].copy_(base)
                        else:  # reference mode, or an fp32 matrix never perturbed (the same bits as a master)
                            p.detach()[start:stop].add_(delta.to(p.dtype))
            if self._vectors is not None:
                sq += self._vectors.update(members, z, lr) ** 2
        finally:
            self.clear_cache()
        return math.sqrt(sq)

    def clear_cache(self) -> None:
        """Drop cached factors and noise (``update`` does this itself)."""
        self._factor_cache.clear()
        if self._vectors is not None:
            self._vectors.clear_cache()

    def sync_from_model(self) -> None:
        """Re-read the base point from the model's current weights (e.g. after loading a checkpoint)."""
        if self.exact_restore:
            for p, b in zip(self._mats, self._mat_base, strict=True):
                if b is not None:
                    b.copy_(p.detach())
        self._current = None
        self._applied.clear()
        if self._vectors is not None:
            self._vectors.sync_from_model()
        self.clear_cache()

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights by name when some evolved parameter is stored below fp32, else ``{}``."""
        params = self._mats + (self._vectors._params if self._vectors is not None else [])
        if not self.exact_restore or all(p.dtype == torch.float32 for p in params):
            return {}
        state = {n: b.detach().cpu() for n, b in zip(self._mat_names, self._master_views(), strict=True)}
        if self._vectors is not None:
            vec = self._vectors.master_state_dict()
            if not vec:  # the full-rank part is all fp32: its values are its master
                vec = {
                    n: p.detach().cpu().float()
                    for n, p in zip(self._vec_names, self._vectors._params, strict=True)
                }
            state.update(vec)
        return state

    def velocity_state_dict(self) -> dict[str, torch.Tensor]:
        state = super().velocity_state_dict()
        if self._vectors is not None:
            state.update(self._vectors.velocity_state_dict())
        return state

    def load_velocity_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_velocity_state_dict(state)  # checks the names
        vecs = set(self._vec_names)
        self._velocity = {n: v for n, v in self._velocity.items() if n not in vecs}
        if self._vectors is not None:
            self._vectors.load_velocity_state_dict({n: t for n, t in state.items() if n in vecs})

    def load_master_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load fp32 master weights saved by :meth:`master_state_dict` and write them into the model."""
        if not self.exact_restore:
            raise RuntimeError("load_master_state_dict needs exact_restore=True")
        check_master_names(self._names, state)
        self.restore()
        load_master_into(self._mat_names, self._mats, self._master_views(), state)
        if self._vectors is not None:
            self._vectors.load_master_state_dict({n: state[n] for n in self._vec_names})
        self.clear_cache()

    # ----------------------------------------------------------------------------------- batched forward
    def _owners(self) -> list[tuple[nn.Module, str, str]]:
        """``(module, attribute, evolved name)`` for every place an evolved parameter is used directly."""
        by_id = {id(p): n for n, p in zip(self._mat_names, self._mats, strict=True)}
        if self._vectors is not None:
            by_id.update({id(p): n for n, p in zip(self._vec_names, self._vectors._params, strict=True)})
        owners = []
        for module in self.model.modules():
            for attr, p in module._parameters.items():
                if p is not None and id(p) in by_id:
                    owners.append((module, attr, by_id[id(p)]))
        return owners

    def check_batchable(self) -> None:
        """Raise ``NotImplementedError`` if some evolved parameter lives in a module :meth:`batched` can't hook.

        Supported: ``nn.Linear`` (weight low-rank, bias full-rank), ``nn.Embedding``, ``nn.LayerNorm`` and
        ``*RMSNorm`` modules (the Hugging Face kind: output ``= weight * normalized(x)``, elementwise).
        """
        bad = sorted(
            {f"{type(m).__name__}.{attr}" for m, attr, _ in self._owners() if _kind(m, attr) is None}
        )
        if bad:
            # Named by architecture: this is what a user of an unsupported model sees at trainer set-up.
            raise NotImplementedError(
                f"{type(self.model).__name__}: low-rank population batching on the transformers backend cannot "
                f"hook these modules' trainable parameters: {bad}. Supported: nn.Linear, nn.Embedding (and Gemma's "
                "scaled embedding), nn.LayerNorm and *RMSNorm modules. perturbation='full' runs this architecture "
                "(on transformers, and on vLLM where vLLM supports it); or freeze those parameters"
            )

    @contextlib.contextmanager
    def batched(
        self, members: Sequence[Member], dtype: torch.dtype | None = None, model: nn.Module | None = None
    ) -> Iterator[None]:
        """Inside the block, one forward pass evaluates all ``members`` on shared base weights.

        The batch must hold ``len(members) * k`` rows, member-major: rows ``[g*k, (g+1)*k)`` see member
        ``members[g]``'s perturbation (``generate`` keeps this layout; beams and ``num_return_sequences``
        stay contiguous too). The weights are never written, so there is nothing to restore; the hooks are
        removed on exit, exceptions included. ``dtype``: the activation dtype (default: the first matrix's, or
        ``model``'s). ``model``: hook this copy of the model instead (same module paths, e.g. a bf16 generation
        copy, :class:`~trl_dart_es.rollout.generation_copy.GenerationCopy`); the noise is the evolved tensors'.
        """
        members = list(members)
        if not members or not all(isinstance(m, Member) for m in members):
            raise TypeError("batched() needs a non-empty sequence of Members")
        if self.is_perturbed:
            raise RuntimeError("batched() needs the base weights; restore() the applied member first")
        if self._in_batched:
            raise RuntimeError("batched() contexts cannot be nested")
        self.check_batchable()
        owners = self._owners()
        params = self._mats + (self._vectors._params if self._vectors is not None else [])
        if model is not None:  # the same modules, by path, in the copy
            paths = {id(m): path for path, m in self.model.named_modules()}
            owners = [(model.get_submodule(paths[id(m)]), attr, name) for m, attr, name in owners]
            dtype = dtype or next(model.parameters()).dtype
        dtype = dtype or params[0].dtype
        prep = _Prepared(self, members, dtype)
        handles: list = []
        swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
        try:
            for module, attr, name in owners:
                handles += _install(module, attr, name, _kind(module, attr), prep, swapped)
            self._in_batched = True
            yield
        finally:
            self._in_batched = False
            for h in handles:
                h.remove()
            for module, attr, original in swapped:  # an exception mid-forward may leave a swap in place
                module._parameters[attr] = original

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(lowrank={len(self._mats)}, fullrank={len(self._vec_names)}, "
            f"num_parameters={self.num_parameters:,}, sigma={self.sigma}, rank={self.rank}, "
            f"exact_restore={self.exact_restore})"
        )


def lora_carried_names(model: nn.Module) -> list[str]:
    """Trainable parameters a LoRA adapter can carry: the weights of the linear layers (attention and MLP
    projections), in ``named_parameters()`` order.

    Left out: embeddings, the output head (tied to the embedding or not: vLLM's LoRA layers do not carry it),
    norm gains, biases and every other non-``nn.Linear`` parameter. With ``LowRankParameters(...,
    names=lora_carried_names(model))`` the population is exactly what a set of per-member LoRA adapters of
    rank ``r`` can express, so the transformers and vLLM low-rank backends run the same algorithm.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    excluded = {
        id(m.weight) for m in (head, embed) if m is not None and getattr(m, "weight", None) is not None
    }
    linear_weights = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, nn.Linear) and m is not head and m.weight.requires_grad
    }
    return [n for n, p in model.named_parameters() if id(p) in linear_weights and id(p) not in excluded]


def owning_module(name: str) -> str:
    """The last component of a parameter's module path: ``"model.layers.3.mlp.down_proj.weight"`` -> ``"down_proj"``."""
    return name.rsplit(".", 2)[-2] if "." in name else ""


def select_by_module(names: Sequence[str], modules: Collection[str]) -> list[str]:
    """The parameter names in ``names`` whose owning module is named one of ``modules``.

    A module matches on the last component of its path, as PEFT's ``target_modules`` does:
    ``"model.layers.3.mlp.down_proj.weight"`` is owned by ``down_proj``. Raises if a module name matches none
    of ``names``, so a typo does not silently evolve less than asked.
    """
    wanted = set(modules)
    owner = {n: owning_module(n) for n in names}
    unmatched = sorted(wanted - set(owner.values()))
    if unmatched:
        known = sorted(set(owner.values()))
        raise ValueError(
            f"lowrank_target_modules {unmatched} match no evolvable tensor; modules here: {known}"
        )
    return [n for n in names if owner[n] in wanted]


# ------------------------------------------------------------------------------------------- batching
def _is(module: nn.Module, cls: type) -> bool:
    # Subclasses that change forward (e.g. scaled embeddings) would silently break the algebra: refuse them.
    return isinstance(module, cls) and type(module).forward is cls.forward


def _is_scaled_embedding(module: nn.Module) -> bool:
    """Gemma's ``*ScaledWordEmbedding``: ``nn.Embedding`` whose forward is ``embedding(ids) * embed_scale``."""
    return (
        isinstance(module, nn.Embedding)
        and type(module).__name__.endswith("ScaledWordEmbedding")
        and isinstance(getattr(module, "embed_scale", None), torch.Tensor)
        and module.embed_scale.numel() == 1
    )


def _kind(module: nn.Module, attr: str) -> str | None:
    if _is(module, nn.Linear) and attr in ("weight", "bias"):
        return f"linear.{attr}"
    if _is(module, nn.Embedding) and attr == "weight":
        return "embedding.weight"
    if _is_scaled_embedding(module) and attr == "weight":
        # (E + D)[ids] * s = E[ids] * s + D[ids] * s: the hook adds the member's rows times the same scale.
        return "embedding.weight"
    if _is(module, nn.LayerNorm) and attr in ("weight", "bias") and len(module.normalized_shape) == 1:
        return f"layernorm.{attr}"
    if type(module).__name__.endswith("RMSNorm") and attr == "weight" and module.weight.dim() == 1:
        return "rmsnorm.weight"
    return None


class _Prepared:
    """Per-member tensors for one batched() block, built lazily per parameter name and shared by tied uses."""

    def __init__(self, params: LowRankParameters, members: list[Member], dtype: torch.dtype):
        self.params = params
        self.members = members
        self.groups = len(members)
        self.dtype = dtype
        self._mat: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._vec: dict[str, torch.Tensor] = {}

    def matrix(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cA^T, B)``: ``(G, r, m)`` scaled by ``sign*sigma/sqrt(r)``, and ``(G, n, r)``."""
        if name not in self._mat:
            p = self.params
            i = p._mat_names.index(name)
            m = p._mats[i].shape[0]
            x = torch.stack([p._member_factors(mb.seed)[i] for mb in self.members])  # (G, r, m+n)
            c = torch.tensor([mb.sign * p.sigma / math.sqrt(p.rank) for mb in self.members], device=x.device)
            a_t = (x[:, :, :m] * c[:, None, None]).to(self.dtype).contiguous()
            b = x[:, :, m:].transpose(1, 2).to(self.dtype).contiguous()
            self._mat[name] = (a_t, b)
        return self._mat[name]

    def vector(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """``sign*sigma*eps`` per member, ``(G, numel)`` in float32 (the full-rank noise EvolvedParameters uses)."""
        if name not in self._vec:
            eps = torch.stack(
                [gaussian(mb.seed, name, param.shape, device=param.device).view(-1) for mb in self.members]
            )
            c = torch.tensor([mb.sign * self.params.sigma for mb in self.members], device=eps.device)
            self._vec[name] = eps * c[:, None]
        return self._vec[name]


def _groups(prep: _Prepared, rows: int) -> int:
    g = prep.groups
    if rows % g:
        raise RuntimeError(f"batched(): {rows} rows cannot be split evenly among {g} members")
    return g


def _install(module, attr, name, kind, prep: _Prepared, swapped: list) -> list:
    param = module._parameters[attr]

    if kind == "linear.weight":

        def hook(mod, args, out):
            x = args[0]
            g = _groups(prep, x.shape[0])
            a_t, b = prep.matrix(name)
            y = torch.bmm(x.reshape(g, -1, x.shape[-1]), b.to(x.dtype))  # (G, L, r)
            # In place, out += y @ (c A^T): no (G, L, m) temporary, one extra pass over the output.
            out.view(g, -1, out.shape[-1]).baddbmm_(y.to(out.dtype), a_t.to(out.dtype))
            return out

    elif kind == "linear.bias":

        def hook(mod, args, out):
            g = _groups(prep, out.shape[0])
            out.view(g, -1, out.shape[-1]).add_(prep.vector(name, param)[:, None, :].to(out.dtype))
            return out

    elif kind == "embedding.weight":

        def hook(mod, args, out):
            ids = args[0]
            g = _groups(prep, ids.shape[0])
            a_t, b = prep.matrix(name)  # a_t: (G, r, V), b: (G, d, r)
            ids = ids.reshape(g, -1)
            rows = torch.arange(g, device=ids.device)[:, None]
            a_sel = a_t.transpose(1, 2)[rows, ids]  # (G, L, r): c * A[tok]
            b_t = b.transpose(1, 2).to(out.dtype)
            if _is_scaled_embedding(mod):  # the module scales its output: scale the member's rows alike
                b_t = b_t * mod.embed_scale.to(mod.weight.dtype).to(out.dtype)
            out.view(g, -1, out.shape[-1]).baddbmm_(a_sel.to(out.dtype), b_t)
            return out

    elif kind.startswith("layernorm."):

        def hook(mod, args, out):
            x = args[0]
            g = _groups(prep, x.shape[0])
            delta = prep.vector(name, param)[:, None, :]
            if kind == "layernorm.weight":  # (w + d) * n + b = out + d * n, n the unscaled normalised input
                normed = F.layer_norm(x, mod.normalized_shape, None, None, mod.eps)
                delta = delta * normed.reshape(g, -1, x.shape[-1]).float()
            out.view(g, -1, out.shape[-1]).add_(delta.to(out.dtype))
            return out

    elif kind == "rmsnorm.weight":
        # out = weight * normalised(x) elementwise: swap in a per-row weight that broadcasts over the rows.
        def pre(mod, args):
            x = args[0]
            g = _groups(prep, x.shape[0])
            w = (param.detach().float().view(1, -1) + prep.vector(name, param)).to(param.dtype)  # (G, d)
            shape = (g, 1) + (1,) * (x.dim() - 2) + (w.shape[-1],)
            expand = (g, x.shape[0] // g) + (1,) * (x.dim() - 2) + (w.shape[-1],)
            rows = w.view(shape).expand(expand).reshape((x.shape[0],) + shape[2:])
            swapped.append((mod, attr, param))
            mod._parameters[attr] = rows

        def post(mod, args, out):
            mod._parameters[attr] = param
            swapped.pop()
            return out

        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    else:  # pragma: no cover - check_batchable() ran first
        raise NotImplementedError(kind)
    return [module.register_forward_hook(hook)]
