"""Momentum on the ES update (`momentum`): v <- mu v + (1 - mu) delta, theta += v, on both parameter sets.

Each test computes the plain ES updates delta_t with momentum off, on a copy of the same model, and checks what
momentum applies against the formula; no expected number is written down."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

from trl_dart_es.lowrank import LowRankParameters
from trl_dart_es.noise import population
from trl_dart_es.perturb import EvolvedParameters

MU = 0.75


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # Linear matrices (low rank there) and biases and LayerNorm gains (full rank in both sets).
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def make(kind: str, model: nn.Module, momentum: float = 0.0):
    if kind == "fullrank":
        return EvolvedParameters(model, 0.01, momentum=momentum)
    return LowRankParameters(model, 0.01, rank=2, momentum=momentum)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def steps(seed: int, count: int, n: int = 6):
    rng = np.random.default_rng(seed)
    return [(population(1000 + t, n, antithetic=True), rng.standard_normal(n)) for t in range(count)]


KINDS = ["fullrank", "lowrank"]


@pytest.mark.parametrize("kind", KINDS)
def test_momentum_applies_the_running_average_of_the_plain_updates(kind):
    plain_model, mom_model = small_model(), small_model()
    plain, mom = make(kind, plain_model), make(kind, mom_model, MU)
    v = torch.zeros_like(flat(mom_model))
    for members, z in steps(0, 4):
        before_plain, before_mom = flat(plain_model), flat(mom_model)
        plain.update(members, z, lr=0.1)
        norm = mom.update(members, z, lr=0.1)
        delta = flat(plain_model) - before_plain  # each step's plain update (the plain run's own point)
        v = MU * v + (1 - MU) * delta
        applied = flat(mom_model) - before_mom
        torch.testing.assert_close(applied, v, rtol=1e-4, atol=1e-7)
        assert norm == pytest.approx(float(v.norm()), rel=1e-4)
    # The noise does not depend on where the weights are, so the plain deltas are the ones momentum saw.
    assert not torch.allclose(flat(plain_model), flat(mom_model))


@pytest.mark.parametrize("kind", KINDS)
def test_momentum_shrinks_steps_that_average_noise_and_keeps_steps_that_repeat(kind):
    """Fresh populations with random fitness (noise): momentum's steps are much shorter than plain ES's.
    The same population and fitness every step (a consistent signal): its steps grow back to plain length."""
    noisy = make(kind, small_model(), MU)
    plain = make(kind, small_model())
    noisy_norms, plain_norms = [], []
    for members, z in steps(1, 30):
        noisy_norms.append(noisy.update(members, z, lr=0.1))
        plain_norms.append(plain.update(members, z, lr=0.1))
    assert np.mean(noisy_norms[10:]) < 0.7 * np.mean(plain_norms[10:])

    steady = make(kind, small_model(), MU)
    members, z = steps(2, 1)[0]
    norms = [steady.update(members, z, lr=0.1) for _ in range(40)]
    plain_norm = make(kind, small_model()).update(members, z, lr=0.1)
    assert norms[0] == pytest.approx((1 - MU) * plain_norm, rel=1e-4)
    assert norms[-1] == pytest.approx(plain_norm, rel=1e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_velocity_state_round_trip_continues_bitwise(kind):
    model = small_model()
    params = make(kind, model, MU)
    history = steps(3, 4)
    for members, z in history[:2]:
        params.update(members, z, lr=0.1)
    state = params.velocity_state_dict()
    assert set(state) == set(params.names)
    resumed_model = copy.deepcopy(model)
    resumed = make(kind, resumed_model, MU)
    resumed.load_velocity_state_dict(state)
    for members, z in history[2:]:
        params.update(members, z, lr=0.1)
        resumed.update(members, z, lr=0.1)
    for (name, a), b in zip(model.named_parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b), name

    with pytest.raises(ValueError, match="not evolved parameters"):
        resumed.load_velocity_state_dict({"no.such.weight": torch.zeros(3)})


@pytest.mark.parametrize("kind", KINDS)
def test_momentum_is_off_by_default_and_keeps_no_state(kind):
    params = make(kind, small_model())
    members, z = steps(4, 1)[0]
    params.update(members, z, lr=0.1)
    assert params.momentum == 0.0 and params.velocity_state_dict() == {}


@pytest.mark.parametrize("bad", [1.0, -0.1, float("nan")])
def test_momentum_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match=rf"momentum must be in \[0, 1\), got {bad}"):
        EvolvedParameters(small_model(), 0.01, momentum=bad)


def test_momentum_needs_the_fp32_master():
    with pytest.raises(ValueError, match="momentum needs exact_restore=True"):
        LowRankParameters(small_model(), 0.01, exact_restore=False, momentum=0.5)


@pytest.mark.parametrize(
    "kw, why",
    [
        ({"momentum": 1.0}, r"momentum=1.0 is invalid"),
        ({"momentum": 0.5, "exact_restore": False}, "needs exact_restore=True"),
    ],
)
def test_config_refuses_bad_momentum_naming_the_value(tmp_path, kw, why):
    from conftest import tiny_es_config

    with pytest.raises(ValueError, match=why):
        tiny_es_config(tmp_path, **kw)
