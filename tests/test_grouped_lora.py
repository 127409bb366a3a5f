"""The grouped multi-LoRA ops against vLLM's own CPU Punica wrapper, on random stacks (milliseconds)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.lora.layers.utils import LoRAMapping  # noqa: E402
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU  # noqa: E402

from trl_dart_es.rollout import grouped_lora  # noqa: E402
from trl_dart_es.trainer import DartESConfig  # noqa: E402

MAX_LORAS, FAN_IN = 4, 48


@pytest.fixture
def restore_vllm_ops():
    was = grouped_lora.installed()
    yield
    if was:
        grouped_lora.install()
    else:
        grouped_lora.uninstall()


def _stacks(rank: int, fan_outs: tuple[int, ...], generator: torch.Generator):
    a = tuple(torch.randn(MAX_LORAS, 1, rank, FAN_IN, generator=generator) for _ in fan_outs)
    b = tuple(torch.randn(MAX_LORAS, 1, out, rank, generator=generator) for out in fan_outs)
    return a, b


def _lora_linear(token_ids: list[int], rank: int, fan_outs: tuple[int, ...], is_prefill: bool, grouped: bool):
    """One `add_lora_linear` through a real `PunicaWrapperCPU` (vLLM's ops or the grouped ones)."""
    g = torch.Generator().manual_seed(rank * 100 + len(fan_outs))
    a, b = _stacks(rank, fan_outs, g)
    x = torch.randn(len(token_ids), FAN_IN, generator=g)
    y = torch.randn(len(token_ids), sum(fan_outs), generator=g)
    if grouped:
        grouped_lora.install()
    else:
        grouped_lora.uninstall()
    wrapper = PunicaWrapperCPU(max_num_batched_tokens=64, max_batches=8, device="cpu")
    # Adapter ids 1..MAX_LORAS live in slots 0..MAX_LORAS-1; id 0 means "no adapter".
    mapping = LoRAMapping(index_mapping=token_ids, prompt_mapping=token_ids, is_prefill=is_prefill)
    wrapper.update_metadata(mapping, list(range(1, MAX_LORAS + 1)), MAX_LORAS, 1000)
    wrapper.add_lora_linear(y, x, a, b, 0.5, fan_outs)
    return y


@pytest.mark.parametrize("is_prefill", [True, False], ids=["prefill", "decode"])
@pytest.mark.parametrize("fan_outs", [(40,), (40, 16, 16)], ids=["one-slice", "qkv-slices"])
@pytest.mark.parametrize("rank", [1, 8])
def test_grouped_ops_match_vllms_cpu_punica_wrapper(rank, fan_outs, is_prefill, restore_vllm_ops):
    tokens = [1, 1, 1, 2, 2, 3, 4, 4, 4, 4, 2, 1]  # every token has an adapter, as in an ES population
    theirs = _lora_linear(tokens, rank, fan_outs, is_prefill, grouped=False)
    ours = _lora_linear(tokens, rank, fan_outs, is_prefill, grouped=True)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [1, 8])
def test_fused_lora_linear_equals_shrink_then_expand(rank, dtype):
    """The one-pass op gives the values of the two ops through vLLM's fp32 buffers, tokens without a slot included."""
    g = torch.Generator().manual_seed(rank)
    fan_outs = (40, 16, 16)
    a, b = _stacks(rank, fan_outs, g)
    a, b = tuple(t.to(dtype) for t in a), tuple(t.to(dtype) for t in b)
    tokens = grouped_lora.TokenAdapters(torch.tensor([0, 3, -1, 1, 1, 2, -1, 0]))
    x = torch.randn(8, FAN_IN, generator=g).to(dtype)
    y0 = torch.randn(8, sum(fan_outs), generator=g).to(dtype)
    two_step, fused = y0.clone(), y0.clone()
    buffers = tuple(torch.zeros(8, rank) for _ in fan_outs)
    grouped_lora.grouped_shrink(buffers, x, a, tokens, 0.5)
    grouped_lora.grouped_expand(two_step, buffers, b, tokens, fan_outs)
    grouped_lora.grouped_lora_linear(fused, x, a, b, tokens, 0.5, fan_outs)
    if rank == 1:  # one product per output: bitwise
        assert torch.equal(fused, two_step)
    else:  # the r products of a slot may be summed in another order (the GEMMs' K differs)
        torch.testing.assert_close(fused, two_step)
    assert torch.equal(fused[[2, 6]], y0[[2, 6]]) and not torch.equal(fused, y0)


def test_tokens_without_an_adapter_get_no_delta(restore_vllm_ops):
    y = _lora_linear([0, 2, 0, 3, 0, 0], 1, (40,), False, grouped=True)
    base = _lora_linear([0, 0, 0, 0, 0, 0], 1, (40,), False, grouped=True)  # same x, y, stacks (same seed)
    assert torch.equal(y[[0, 2, 4, 5]], base[[0, 2, 4, 5]])  # untouched rows
    assert not torch.equal(y[[1, 3]], base[[1, 3]])  # rows with an adapter got their delta


def test_install_and_uninstall_swap_the_wrapper_methods(restore_vllm_ops):
    grouped_lora.uninstall()
    original = PunicaWrapperCPU.add_shrink
    grouped_lora.install()
    grouped_lora.install()  # idempotent: the originals are kept once
    assert grouped_lora.installed() and PunicaWrapperCPU.add_shrink is not original
    grouped_lora.uninstall()
    assert not grouped_lora.installed() and PunicaWrapperCPU.add_shrink is original


def test_config_names_a_bad_lora_kernel(tmp_path):
    with pytest.raises(ValueError, match="vllm_lora_kernel"):
        DartESConfig(output_dir=str(tmp_path), vllm_lora_kernel="fast")
    assert DartESConfig(output_dir=str(tmp_path)).vllm_lora_kernel == "grouped"


def _fused(a, b, x, y0, tokens, fan_outs):
    y = y0.clone()
    grouped_lora.grouped_lora_linear(y, x, a, b, tokens, 0.5, fan_outs)
    return y


@pytest.mark.parametrize("inference", [False, True], ids=["tracked", "inference-tensors"])
def test_fused_op_sees_an_adapter_written_in_place_after_a_cached_call(inference):
    """The stacked matrices are kept between calls; vLLM loads an adapter by writing its slot in place, and the
    next call must use the new values (inference tensors, which have no version counter, are not cached)."""
    g = torch.Generator().manual_seed(7)
    fan_outs = (40, 16, 16)
    with torch.inference_mode(inference):
        a, b = _stacks(1, fan_outs, g)
        x = torch.randn(6, FAN_IN, generator=g)
        y0 = torch.randn(6, sum(fan_outs), generator=g)
        tokens = grouped_lora.TokenAdapters(torch.tensor([0, 1, 2, 3, 1, 0]))
        before = _fused(a, b, x, y0, tokens, fan_outs)
        assert torch.equal(
            before, _fused(a, b, x, y0, tokens, fan_outs)
        )  # a cached call gives the same values
        a[1][2].mul_(3.0)  # slot 2 of slice 1's A, as set_lora writes it
        b[0][1].zero_()  # slot 1 of slice 0's B
        after = _fused(a, b, x, y0, tokens, fan_outs)
        buffers = tuple(torch.zeros(6, 1) for _ in fan_outs)
        expected = y0.clone()
        grouped_lora.grouped_shrink(buffers, x, a, tokens, 0.5)  # the uncached two-op path on the new stacks
        grouped_lora.grouped_expand(expected, buffers, b, tokens, fan_outs)
    assert torch.equal(after, expected) and not torch.equal(after, before)


def test_fused_op_never_reuses_stacks_of_freed_tensors_at_the_same_address():
    """New stacks can land where freed ones were, with the same version (0): the cache must not serve them."""
    fan_outs = (40, 16, 16)
    tokens = grouped_lora.TokenAdapters(torch.tensor([0, 1, 2, 3, 1, 0]))
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        a, b = _stacks(8, fan_outs, g)
        x, y0 = torch.randn(6, FAN_IN, generator=g), torch.randn(6, sum(fan_outs), generator=g)
        buffers = tuple(torch.zeros(6, 8) for _ in fan_outs)
        expected = y0.clone()
        grouped_lora.grouped_shrink(buffers, x, a, tokens, 0.5)
        grouped_lora.grouped_expand(expected, buffers, b, tokens, fan_outs)
        torch.testing.assert_close(_fused(a, b, x, y0, tokens, fan_outs), expected)
        del a, b  # freed: the next seed's stacks may take their addresses
