"""Grouped multi-LoRA matmuls for vLLM on CPU: the population's adapters as two small GEMMs per layer.

vLLM's CPU Punica ops (``vllm.lora.ops.torch_ops``) copy each token's adapter out of the stacked weights
(``w[token_indices]``: T x out x r floats per layer and slice) and then run a batched einsum. In prefill every
prompt token gets its own copy, and vLLM 0.32 takes the prefill path (``sgmv``, with two
``repeat_interleave`` calls) at every step of the V1 scheduler. Profiled on the quickstart population (8
rank-1 adapters, 64 rows of 40 tokens, 2 cores), those ops cost ~7 s of a ~22 s `generate` that takes ~14 s
without LoRA.

With a handful of adapters the whole stack fits in one small GEMM, so no per-token copy is needed:

* shrink: ``s = x @ A_all^T`` (``T x L*r``, every adapter at once), then each token keeps its adapter's ``r``
  columns;
* expand: each token's ``r`` values go into its adapter's block of a ``T x L*r`` row (zeros elsewhere) and
  one GEMM with ``B_all`` (``L*r x out``) adds every token's delta; the fused op stacks the slices too, with the
  B stacks block-diagonal, and keeps both stacked matrices until an adapter changes.

vLLM's linear LoRA layers call ``add_lora_linear`` (shrink into fp32 buffers, then expand); the replacement
does both in one pass (:func:`grouped_lora_linear`): the shrink GEMM's output, masked by the one-hot
token-to-adapter matrix, is the expand's input, with no buffers between them.

The zero blocks contribute exact zeros, so the result is vLLM's up to the order in which the dot products are
summed (float rounding only). A token with index -1 (no adapter) gets no delta, the
meaning vLLM's GPU kernels give it (its CPU ops index the last slot instead). Installed by
:func:`~trl_dart_es.rollout.vllm.start_engine` for CPU engines with LoRA when
``DartESConfig.vllm_lora_kernel='grouped'`` (the default); ``'vllm'`` keeps vLLM's own ops.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

__all__ = [
    "TokenAdapters",
    "grouped_expand",
    "grouped_lora_linear",
    "grouped_shrink",
    "install",
    "installed",
    "uninstall",
]

_ORIGINAL: dict[str, object] = {}


class TokenAdapters:
    """Which adapter each token of a forward pass uses, prepared once per pass for every layer's ops.

    ``indices``: ``(T,)`` slot per token, -1 for none. :meth:`one_hot` gives the ``(T, L)`` token-to-adapter
    matrix (a zero row for a token without an adapter), built once per pass, adapter count and dtype, so
    that each layer's ops are a multiply and a GEMM with no per-layer index writes.
    """

    def __init__(self, indices: torch.Tensor):
        self.n = int(indices.shape[0])
        self.indices = indices
        self.none = self.n == 0 or not bool((indices >= 0).any())
        self._one_hot: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def one_hot(self, num: int, dtype: torch.dtype) -> torch.Tensor:
        """``(T, num)``: 1 at each token's slot, a zero row for a token without one."""
        key = (num, dtype)
        if key not in self._one_hot:
            slots = self.indices.to(torch.long)
            m = torch.zeros(self.n, num + 1, dtype=dtype, device=slots.device)
            # -1 (no adapter) lands in the spare last column, which is dropped.
            m[torch.arange(self.n, device=slots.device), torch.where(slots < 0, num, slots)] = 1
            self._one_hot[key] = m[:, :num]
        return self._one_hot[key]


def _shrink_all(x: torch.Tensor, ws: Sequence[torch.Tensor], n: int, dtype: torch.dtype) -> torch.Tensor:
    """``(n, S, L, r)``: the first ``n`` tokens of ``x`` against every slice's every adapter, in one GEMM."""
    num_slices, (num, _, r, fan_in) = len(ws), ws[0].shape
    stacked = ws[0] if num_slices == 1 else torch.cat(tuple(ws), dim=0)
    a = stacked.reshape(num_slices * num * r, fan_in).to(dtype)
    return torch.matmul(x.reshape(-1, fan_in)[:n].to(dtype), a.t()).view(n, num_slices, num, r)


def grouped_shrink(
    y: Sequence[torch.Tensor] | torch.Tensor,
    x: torch.Tensor,
    ws: Sequence[torch.Tensor],
    tokens: TokenAdapters,
    scale: float,
) -> None:
    """``y[i][t, :r] = scale * x[t] @ ws[i][slot(t)]^T`` for every slice ``i`` and token ``t`` (0 without a slot).

    ``y``: S buffers ``(T, r)`` (a tuple, or one ``(S, T, r)`` tensor); ``x``: ``(T, in)``; ``ws``: S stacks
    ``(L, 1, r, in)``. All S slices and L adapters are one GEMM; the one-hot matrix then keeps each token's
    adapter (the other adapters' columns are multiplied by exact zeros).
    """
    n, num_slices = tokens.n, len(ws)
    num, r = ws[0].shape[0], ws[0].shape[-2]
    dtype = y[0].dtype
    s = _shrink_all(x, ws, n, dtype)
    one_hot = tokens.one_hot(num, dtype)
    if r == 1:  # (n, S, L) x (n, L, 1): one batched matmul picks every slice's value
        picked = torch.bmm(s.view(n, num_slices, num), one_hot.unsqueeze(-1)).view(n, num_slices, 1)
    else:
        picked = (s * one_hot.view(n, 1, num, 1)).sum(dim=2)  # (n, S, r)
    if scale != 1.0:
        picked = picked * scale
    if isinstance(y, torch.Tensor):
        y[:, :n, :r] = picked.transpose(0, 1)
    else:
        for i in range(num_slices):
            y[i][:n, :r] = picked[:, i]


def grouped_expand(
    y: torch.Tensor,
    x: Sequence[torch.Tensor] | torch.Tensor,
    ws: Sequence[torch.Tensor],
    tokens: TokenAdapters,
    output_slices: Sequence[int],
    offset: int = 0,
    add_inputs: bool = True,
) -> None:
    """``y[t, cols_i] (+)= x[i][t, :r] @ ws[i][slot(t)]^T`` for every slice ``i`` (columns ``cols_i`` follow
    ``output_slices`` from ``offset``) and every token with a slot.

    ``y``: ``(T, out_total)``; ``x``: S buffers ``(T, r)``; ``ws``: S stacks ``(L, 1, out_i, r)``. Each token's
    values, times its one-hot row, fill an ``L*r``-wide row (exact zeros outside its adapter's block), then one
    GEMM per slice with the whole stack.
    """
    n, num_slices = tokens.n, len(ws)
    num, r = ws[0].shape[0], ws[0].shape[-1]
    xs = (x if isinstance(x, torch.Tensor) else torch.stack(tuple(x)))[:num_slices, :n, :r].to(y.dtype)
    rows = xs.unsqueeze(2) * tokens.one_hot(num, y.dtype).view(1, n, num, 1)  # (S, n, L, r), contiguous
    _add_rows(y, rows.view(num_slices, n, num * r), ws, output_slices, offset, add_inputs)


def _add_rows(
    y: torch.Tensor,
    rows: torch.Tensor,
    ws: Sequence[torch.Tensor],
    output_slices: Sequence[int],
    offset: int,
    add_inputs: bool,
) -> None:
    """``y[:n, cols_i] (+)= rows[i] @ B_i`` with ``rows``: ``(S, n, L*r)`` and ``B_i`` slice i's ``(L*r, out_i)`` stack."""
    n, num, r = rows.shape[1], ws[0].shape[0], ws[0].shape[-1]
    y2 = y.view(-1, y.shape[-1])
    for i, w in enumerate(ws):
        fan_out = w.shape[-2]
        width = min(output_slices[i], fan_out)
        stack = w.reshape(num, fan_out, r).to(y.dtype).transpose(1, 2).reshape(num * r, fan_out)
        target = y2[:n, offset : offset + width]
        if add_inputs:  # in place: half the time of a matmul and a separate add at decode sizes
            target.addmm_(rows[i], stack[:, :width])
        else:
            target.copy_(torch.matmul(rows[i], stack[:, :width]))
        offset += output_slices[i]


def grouped_lora_linear(
    y: torch.Tensor,
    x: torch.Tensor,
    a_ws: Sequence[torch.Tensor],
    b_ws: Sequence[torch.Tensor],
    tokens: TokenAdapters,
    scale: float,
    output_slices: Sequence[int],
    add_inputs: bool = True,
) -> None:
    """:func:`grouped_shrink` then :func:`grouped_expand` in one pass: two GEMMs for all slices and adapters.

    The shrink GEMM's output, masked by the one-hot matrix, is the expand's input (no ``(T, r)`` buffers), and
    the expand is ONE GEMM with the slices' B stacks laid out block-diagonally (:func:`_stacked`), which adds
    into the whole of ``y`` at once instead of one strided column block per slice. The blocks off a token's
    adapter and slice are exact zeros, so the values equal the two-op path's (bitwise at rank 1; at higher ranks up
    to the order a slot's r products are summed); the shrink runs in fp32, as vLLM's buffers do.
    """
    n, num_slices = tokens.n, len(a_ws)
    num, r = a_ws[0].shape[0], a_ws[0].shape[-2]
    a_all, b_all = _stacked(a_ws, b_ws, output_slices, y.dtype)
    s = torch.matmul(x.reshape(-1, x.shape[-1])[:n].to(torch.float32), a_all.t()).view(n, num_slices, num, r)
    rows = s * tokens.one_hot(num, torch.float32).view(n, 1, num, 1)  # zeros off each token's slot
    if scale != 1.0:
        rows = rows * scale
    rows = rows.to(y.dtype)
    # Slices that do not tile y's columns: a GEMM per slice.
    if b_all is None or b_all.shape[1] != y.shape[-1]:
        _add_rows(y, rows.view(n, num_slices, num * r).transpose(0, 1), b_ws, output_slices, 0, add_inputs)
        return
    rows = rows.view(n, num_slices * num * r)
    y2 = y.view(-1, y.shape[-1])[:n]
    if add_inputs:  # in place: half the time of a matmul and a separate add at decode sizes
        y2.addmm_(rows, b_all)
    else:
        y2.copy_(torch.matmul(rows, b_all))


# Per layer: the A stacks as one fp32 (S*L*r, in) matrix and the B stacks as one block-diagonal (S*L*r, out)
# matrix. Rebuilding them costs as much as the GEMMs at decode sizes, and they change only when an adapter is
# loaded or removed, which bumps the stacks' version counters (vLLM writes them in place). An entry also holds
# weak references to its stacks: a new tensor at a freed one's address (another engine) never matches it.
_STACKS: dict[tuple, tuple[tuple, tuple[int, ...], torch.Tensor, torch.Tensor | None]] = {}
_MAX_STACKS = 4096


def _stacked(
    a_ws: Sequence[torch.Tensor],
    b_ws: Sequence[torch.Tensor],
    output_slices: Sequence[int],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    weights = (*a_ws, *b_ws)
    key = (*(w.data_ptr() for w in weights), tuple(output_slices), dtype)
    try:
        versions = tuple(w._version for w in weights)
    except RuntimeError:  # inference tensors have no version counter: nothing tells a change, so no cache
        versions = None
    held = _STACKS.get(key)
    if (
        versions is not None
        and held is not None
        and held[1] == versions
        and all(ref() is w for ref, w in zip(held[0], weights, strict=True))
    ):
        return held[2], held[3]
    num, _, r, fan_in = a_ws[0].shape
    a_all = torch.cat([w.reshape(num * r, fan_in) for w in a_ws]).to(torch.float32)
    b_all = None
    if all(w.shape[-2] == width for w, width in zip(b_ws, output_slices, strict=True)):
        b_all = torch.zeros(len(b_ws) * num * r, sum(output_slices), dtype=dtype, device=a_all.device)
        offset = 0
        for i, w in enumerate(b_ws):
            block = w.reshape(num, w.shape[-2], r).transpose(1, 2).reshape(num * r, w.shape[-2])
            b_all[i * num * r : (i + 1) * num * r, offset : offset + w.shape[-2]] = block
            offset += w.shape[-2]
    if versions is not None:
        if len(_STACKS) >= _MAX_STACKS:  # stale layers of an engine that was shut down
            _STACKS.clear()
        _STACKS[key] = (tuple(weakref.ref(w) for w in weights), versions, a_all, b_all)
    return a_all, b_all


# ------------------------------------------------------------------------- PunicaWrapperCPU replacements
def _update_metadata(self, mapping, *args, **kwargs) -> None:
    _ORIGINAL["update_metadata"](self, mapping, *args, **kwargs)
    self._dart_es_tokens = TokenAdapters(self.token_lora_indices)


def _tokens(self) -> TokenAdapters | None:
    tokens = getattr(self, "_dart_es_tokens", None)
    return None if tokens is None or tokens.none else tokens


def _add_shrink(self, y, x, lora_a_stacked, scale, **kwargs) -> None:
    tokens = _tokens(self)
    if tokens is not None:  # else: no token has an adapter and the buffers stay zero
        grouped_shrink(y, x, lora_a_stacked, tokens, scale)


def _add_expand(self, y, x, lora_b_stacked, output_slices, offset_start=0, add_inputs=True, **kwargs) -> None:
    tokens = _tokens(self)
    if tokens is not None:
        grouped_expand(y, x, lora_b_stacked, tokens, output_slices, offset_start, add_inputs)


def _add_lora_linear(
    self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None, **kwargs
) -> None:
    if buffer is not None:  # a caller-owned buffer: keep vLLM's two-step contract
        _ORIGINAL["add_lora_linear"](
            self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, buffer=buffer, **kwargs
        )
        return
    tokens = _tokens(self)
    if tokens is not None:
        add_inputs = kwargs.get("add_inputs", True)
        grouped_lora_linear(y, x, lora_a_stacked, lora_b_stacked, tokens, scale, output_slices, add_inputs)


_REPLACED = {
    "update_metadata": _update_metadata,
    "add_shrink": _add_shrink,
    "add_expand": _add_expand,
    "add_lora_linear": _add_lora_linear,
}


def install() -> bool:
    """Route vLLM's CPU Punica wrapper through the grouped ops (process-wide; idempotent). Returns False, and
    changes nothing, when the installed vLLM has no CPU Punica wrapper."""
    try:
        from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    except ImportError:
        return False
    if _ORIGINAL:
        return True
    for name, fn in _REPLACED.items():
        _ORIGINAL[name] = getattr(PunicaWrapperCPU, name)
        setattr(PunicaWrapperCPU, name, fn)
    return True


def uninstall() -> None:
    """Give vLLM back its own CPU Punica ops."""
    if not _ORIGINAL:
        return
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    for name in _REPLACED:
        setattr(PunicaWrapperCPU, name, _ORIGINAL.pop(name))


def installed() -> bool:
    """Whether the grouped ops are in place."""
    return bool(_ORIGINAL)
