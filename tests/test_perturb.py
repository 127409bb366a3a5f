import numpy as np
import pytest
import torch
from torch import nn

from trl_dart_es import noise as noise_mod
from trl_dart_es.fitness import shape_fitness
from trl_dart_es.noise import CHUNK_SIZE, Member, gaussian, population
from trl_dart_es.perturb import EvolvedParameters

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def small_model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 4)).to(dtype)


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bitwise_equal(model, snap):
    for k, v in model.state_dict().items():
        assert v.dtype == snap[k].dtype
        # Compare bit patterns, not values (so -0.0 vs 0.0 or NaN payloads would show up).
        bits = torch.int32 if v.dtype == torch.float32 else torch.int16
        assert torch.equal(v.view(bits), snap[k].view(bits)), k


class Gains(nn.Module):
    """Norm gains initialised at 1.0, the parameters bf16 handles worst."""

    def __init__(self, n, dtype):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(n, dtype=dtype))


# ---------------------------------------------------------------------------------------------- basics
def test_collects_only_trainable_parameters_once():
    model = small_model()
    model[2].weight.requires_grad_(False)
    model[3].weight = model[0].weight  # wrong shape for a real net, fine for bookkeeping: tied
    params = EvolvedParameters(model, 0.1)
    assert "2.weight" not in params.names
    assert params.names.count("0.weight") == 1 and "3.weight" not in params.names
    assert params.num_parameters == sum(p.numel() for n, p in model.named_parameters() if p.requires_grad)
    frozen = model[2].weight.detach().clone()
    params.perturb(Member(1))
    assert torch.equal(model[2].weight, frozen)


def test_validation_errors():
    with pytest.raises(ValueError, match="sigma"):
        EvolvedParameters(small_model(), 0.0)
    with pytest.raises(ValueError, match="noise_type"):
        EvolvedParameters(small_model(), 0.1, noise_type="lowrank")
    frozen = small_model().requires_grad_(False)
    with pytest.raises(ValueError, match="trainable"):
        EvolvedParameters(frozen, 0.1)
    params = EvolvedParameters(small_model(), 0.1)
    with pytest.raises(TypeError):
        params.perturb(5)
    with pytest.raises(ValueError, match="2 members but 1"):
        params.update([Member(1), Member(2)], [1.0], 0.1)


def test_perturb_is_base_plus_sigma_eps():
    model = small_model()
    snap = snapshot(model)
    params = EvolvedParameters(model, 0.05)
    params.perturb(Member(123, -1))
    assert params.is_perturbed and params.current_member == Member(123, -1)
    for name, p in model.named_parameters():
        ref = snap[name].double() - 0.05 * gaussian(123, name, p.shape).double()
        torch.testing.assert_close(p.detach().double(), ref, rtol=0, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache", [True, False])
def test_restore_is_bitwise(dtype, cache):
    model = small_model(dtype)
    snap = snapshot(model)
    params = EvolvedParameters(model, 0.05, cache_noise=cache)
    members = population(3, 6, antithetic=True)
    for m in members:  # straight from member n to n + 1, no restore in between
        params.perturb(m)
        assert not torch.equal(model[0].weight, snap["0.weight"])
    params.restore()
    assert not params.is_perturbed
    assert_bitwise_equal(model, snap)
    for m in members:
        with params.perturbed(m):
            pass
    assert_bitwise_equal(model, snap)


def test_reference_mode_drifts_in_bf16_but_not_exact_mode():
    members = population(0, 8)
    drifted = {}
    for exact in (True, False):
        model = small_model(torch.bfloat16)
        snap = snapshot(model)
        params = EvolvedParameters(model, 0.05, exact_restore=exact)
        for m in members:
            with params.perturbed(m):
                pass
        drifted[exact] = sum((v != snap[k]).sum().item() for k, v in model.state_dict().items())
    assert drifted[True] == 0
    assert drifted[False] > 0  # (x + d) - d != x after bf16 rounding


def test_reference_mode_restores_in_fp32_closely():
    model = small_model()
    snap = snapshot(model)
    params = EvolvedParameters(model, 0.05, exact_restore=False)
    params.perturb(Member(1))
    params.perturb(Member(2, -1))
    ref = snap["0.weight"].double() - 0.05 * gaussian(2, "0.weight", (16, 8)).double()
    torch.testing.assert_close(model[0].weight.detach().double(), ref, rtol=0, atol=1e-6)
    params.restore()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, snap[k], rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------ noise layout
def test_same_shaped_tensors_get_independent_noise():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    snap = snapshot(model)
    params = EvolvedParameters(model, 1.0)
    params.perturb(Member(9))
    d0 = (model[0].weight.detach() - snap["0.weight"]).flatten()
    d1 = (model[1].weight.detach() - snap["1.weight"]).flatten()
    assert not torch.allclose(d0, d1)
    assert abs(torch.corrcoef(torch.stack([d0, d1]))[0, 1].item()) < 0.1  # 4096 samples: std ~0.016


def test_noise_does_not_depend_on_parameter_order():
    def build(order):
        torch.manual_seed(0)
        layers = {"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)}
        model = nn.ModuleDict({k: layers[k] for k in order})
        return model

    m1, m2 = build("ab"), build("ba")
    assert [n for n, _ in m1.named_parameters()] != [n for n, _ in m2.named_parameters()]
    for m in (m1, m2):
        EvolvedParameters(m, 0.1).perturb(Member(5))
    for name, p in m1.named_parameters():
        assert torch.equal(p, dict(m2.named_parameters())[name])


def test_antithetic_members_mirror():
    model = small_model()
    snap = snapshot(model)
    params = EvolvedParameters(model, 0.05)
    plus, minus = population(1, 2, antithetic=True)
    params.perturb(plus)
    d_plus = model[0].weight.detach() - snap["0.weight"]
    params.perturb(minus)
    d_minus = model[0].weight.detach() - snap["0.weight"]
    torch.testing.assert_close(d_plus, -d_minus, rtol=0, atol=1e-7)
    assert d_plus.abs().max() > 0.01


# ------------------------------------------------------------------------------------------ exceptions
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("exact", [True, False])
def test_perturbed_restores_on_exception(exc, exact):
    model = small_model(torch.float16)
    snap = snapshot(model)
    params = EvolvedParameters(model, 0.05, exact_restore=exact)
    with pytest.raises(exc):
        with params.perturbed(Member(4)):
            assert not torch.equal(model[0].weight, snap["0.weight"])
            raise exc()
    assert not params.is_perturbed
    if exact:
        assert_bitwise_equal(model, snap)
    else:  # reference mode: only back up to fp16 rounding of (x + d) - d
        for k, v in model.state_dict().items():
            torch.testing.assert_close(v, snap[k], rtol=0, atol=2e-3)


def test_interrupted_perturb_is_still_restored(monkeypatch):
    # A perturb interrupted halfway leaves some parameters perturbed: restore must still undo them.
    model = nn.Sequential(nn.Linear(600, 600), nn.Linear(600, 600)).to(torch.bfloat16)
    snap = snapshot(model)
    params = EvolvedParameters(model, 0.05)
    real, calls = noise_mod.fill_chunk, []

    def flaky(tseed, index, out):
        calls.append(index)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(tseed, index, out)

    monkeypatch.setattr("trl_dart_es.perturb.fill_chunk", flaky)
    with pytest.raises(KeyboardInterrupt):
        with params.perturbed(Member(8)):
            pytest.fail("the body must not run")
    assert not params.is_perturbed
    assert_bitwise_equal(model, snap)


# ---------------------------------------------------------------------------------------------- update
def reference_update(snap, members, z, lr, shapes):
    out = {}
    for name, shape in shapes.items():
        delta = sum(
            zn * m.sign * gaussian(m.seed, name, shape).double() for m, zn in zip(members, z, strict=True)
        )
        out[name] = (snap[name].double(), lr / len(members) * delta)
    return out


def test_update_matches_formula_and_returns_norm():
    model = small_model()
    snap = snapshot(model)
    params = EvolvedParameters(model, 0.05)
    members = population(2, 6)
    z = [0.5, -1.0, 1.5, 0.0, -0.25, -0.75]
    for m in members:
        params.perturb(m)
    norm = params.update(members, z, lr=0.3)
    assert not params.is_perturbed and params.cached_seeds == []
    ref = reference_update(snap, members, z, 0.3, {n: p.shape for n, p in model.named_parameters()})
    total = 0.0
    for name, p in model.named_parameters():
        base, delta = ref[name]
        torch.testing.assert_close(p.detach().double(), base + delta, rtol=0, atol=1e-6)
        total += float((delta**2).sum())
    assert norm == pytest.approx(np.sqrt(total), rel=1e-5)


def test_update_same_with_and_without_cache_including_chunked_params():
    results = []
    for cache, evaluated in [(True, "all"), (True, "half"), (False, "all")]:
        model = nn.Sequential(nn.Linear(CHUNK_SIZE // 512 + 3, 512), nn.Linear(512, 8))  # > one chunk
        torch.manual_seed(1)
        for p in model.parameters():
            nn.init.normal_(p)
        params = EvolvedParameters(model, 0.01, cache_noise=cache)
        norms = []
        for step in range(2):  # the second step reuses the first step's cache buffers
            members = population(5 + step, 4, antithetic=True)
            # "half": this process evaluated only some members (as in multi-process training).
            for m in members if evaluated == "all" else members[:2]:
                params.perturb(m)
            params.restore()
            if cache:
                assert len(params.cached_seeds) == (2 if evaluated == "all" else 1)
            norms.append(params.update(members, [0.3, -1.2, 0.9, 0.1], lr=0.05))
        results.append((norms, snapshot(model)))
    for norms, snap in results[1:]:
        assert norms == results[0][0]
        for k, v in snap.items():
            assert torch.equal(v, results[0][1][k]), k


def test_update_while_perturbed_restores_first():
    model = small_model()
    snap = snapshot(model)
    members = population(1, 2)
    params = EvolvedParameters(model, 0.05)
    params.perturb(members[1])
    params.update(members, [1.0, -1.0], lr=0.1)
    other = small_model()
    EvolvedParameters(other, 0.05).update(members, [1.0, -1.0], lr=0.1)
    for k, v in model.state_dict().items():
        assert torch.equal(v, other.state_dict()[k])
        assert not torch.equal(v, snap[k])


def test_bf16_norm_gains_move_under_exact_update_but_not_naive():
    """bf16 near 1.0: every member's increment is below half a bf16 step, their fp32 sum is several steps."""
    n_members, size = 256, 4
    members = population(0, n_members)
    eps = np.stack([gaussian(m.seed, "gain", (size,)).double().numpy() for m in members])  # N x 4
    z = shape_fitness(eps.sum(axis=1))  # fitness: "larger gains are better"
    half_step_below_one = 2.0**-9  # bf16 spacing is 2**-8 just below 1.0 and 2**-7 just above
    lr = n_members * 0.9 * half_step_below_one / np.abs(z[:, None] * eps).max()
    increments = lr / n_members * z[:, None] * eps
    delta64 = increments.sum(axis=0)
    # Preconditions of the example (checked, not assumed): each increment alone rounds away, the sum does not.
    assert np.abs(increments).max() < half_step_below_one
    assert np.all(delta64 > 2.0**-7)

    result = {}
    for exact in (True, False):
        model = Gains(size, torch.bfloat16)
        EvolvedParameters(model, 1e-3, exact_restore=exact).update(members, z, lr)
        result[exact] = model.gain.detach().double().numpy()
    assert np.all(result[False] == 1.0)  # naive in-place bf16: every increment lost
    assert np.all(result[True] > 1.0)
    # Within bf16 rounding of the fp64 reference: half a step of 2**-7 above 1.0.
    assert np.all(np.abs(result[True] - (1.0 + delta64)) <= 2.0**-8 + 1e-6)


# ---------------------------------------------------------------------------------- checkpoint helpers
def test_sync_from_model_rereads_base():
    model, other = small_model(seed=0), small_model(seed=1)
    params = EvolvedParameters(model, 0.05)
    params.perturb(Member(1))
    model.load_state_dict(other.state_dict())
    params.sync_from_model()
    assert not params.is_perturbed
    with params.perturbed(Member(2)):
        pass
    assert_bitwise_equal(model, snapshot(other))


def test_master_state_dict_round_trip_bf16():
    model = small_model(torch.bfloat16)
    params = EvolvedParameters(model, 0.05)
    params.update(population(0, 4), [1.0, -1.0, 0.5, -0.5], lr=1e-3)
    master = params.master_state_dict()
    assert set(master) == set(params.names) and all(v.dtype == torch.float32 for v in master.values())
    fresh = small_model(torch.bfloat16)
    fresh.load_state_dict(model.state_dict())
    restored = EvolvedParameters(fresh, 0.05)
    restored.load_master_state_dict(master)
    assert all(
        torch.equal(a, b) for a, b in zip(restored.master_state_dict().values(), master.values(), strict=True)
    )
    assert EvolvedParameters(small_model(), 0.05).master_state_dict() == {}  # fp32: the model is the master


# ------------------------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_restore_bitwise_and_cache_invariance(dtype):
    model = small_model(dtype).cuda()
    snap = snapshot(model)
    members = population(0, 4, antithetic=True)
    params = EvolvedParameters(model, 0.05)
    for m in members:
        params.perturb(m)
    delta = model[0].weight.detach().float() - snap["0.weight"].float()
    expected = 0.05 * gaussian(members[-1].seed, "0.weight", (16, 8), device="cuda") * members[-1].sign
    torch.testing.assert_close(delta, expected, rtol=0, atol=2**-8)  # > bf16 rounding of |x| < 1
    params.restore()
    assert_bitwise_equal(model, snap)
    params.update(members, [1.0, -0.5, 0.25, 2.0], lr=0.01)
    other = small_model(dtype).cuda()
    EvolvedParameters(other, 0.05, cache_noise=False).update(members, [1.0, -0.5, 0.25, 2.0], lr=0.01)
    for k, v in model.state_dict().items():
        assert torch.equal(v, other.state_dict()[k])
