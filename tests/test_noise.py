import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from trl_dart_es import noise
from trl_dart_es.noise import (
    CHUNK_SIZE,
    Member,
    chunk_seed,
    derive_step_seed,
    fill_chunk,
    gaussian,
    population,
    tensor_seed,
)


def test_member_validates_sign():
    assert Member(3).sign == 1
    with pytest.raises(ValueError, match="sign"):
        Member(3, 0)


def test_population_distinct_deterministic():
    a = population(123, 16)
    assert a == population(123, 16)
    assert len({m.seed for m in a}) == 16
    assert all(m.sign == 1 for m in a)
    assert {m.seed for m in a}.isdisjoint({m.seed for m in population(124, 16)})
    assert all(0 <= m.seed < 2**63 for m in a)


def test_population_antithetic_pairs():
    pop = population(7, 6, antithetic=True)
    assert [m.sign for m in pop] == [1, -1] * 3
    assert [m.seed for m in pop[::2]] == [m.seed for m in pop[1::2]]
    assert len({m.seed for m in pop}) == 3


def test_population_antithetic_odd_size_names_value():
    with pytest.raises(ValueError, match="5"):
        population(0, 5, antithetic=True)
    with pytest.raises(ValueError):
        population(0, 0)


def test_derive_step_seed():
    assert derive_step_seed(0, 1) == derive_step_seed(0, 1)
    assert len({derive_step_seed(s, t) for s in range(3) for t in range(50)}) == 150


def test_tensor_seed_is_blake2b_of_seed_and_name():
    # The documented definition, recomputed here: BLAKE2b, never Python's per-process hash().
    name = "model.layers.0.mlp.up_proj.weight"
    digest = hashlib.blake2b(
        (42).to_bytes(8, "little") + name.encode(), digest_size=8, person=b"dart-es/tensor"
    ).digest()
    assert tensor_seed(42, name) == int.from_bytes(digest, "little") & (2**63 - 1)
    assert 0 <= tensor_seed(42, "a") < 2**63
    assert tensor_seed(42, "a") != tensor_seed(42, "b") != tensor_seed(43, "b")


def test_gaussian_moments_and_dtype():
    x = gaussian(1, "w", (1000, 600))
    assert x.dtype == torch.float32 and x.shape == (1000, 600)
    assert abs(x.mean().item()) < 0.01
    assert abs(x.std().item() - 1.0) < 0.01
    # A Gaussian's fourth standardised moment is 3.
    assert abs((x**4).mean().item() - 3.0) < 0.05


def test_gaussian_independent_across_same_shaped_tensors():
    # The pitfall: one seed for every tensor gives every same-shaped tensor the same noise.
    a = gaussian(5, "layers.0.q_proj.weight", (256, 256)).flatten()
    b = gaussian(5, "layers.1.q_proj.weight", (256, 256)).flatten()
    assert not torch.equal(a, b)
    corr = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    assert abs(corr) < 0.02  # 65k samples: std of the estimate ~0.004


def test_gaussian_order_independent_and_deterministic():
    first = gaussian(9, "a", (3, 4))
    gaussian(9, "b", (5,))
    gaussian(10, "a", (3, 4))
    assert torch.equal(gaussian(9, "a", (3, 4)), first)


def test_gaussian_out_buffer_and_errors():
    buf = torch.empty(4, 5)
    res = gaussian(2, "x", (4, 5), out=buf)
    assert res.data_ptr() == buf.data_ptr()
    assert torch.equal(buf, gaussian(2, "x", (4, 5)))
    with pytest.raises(ValueError, match="float32"):
        gaussian(2, "x", (4, 5), out=torch.empty(4, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="shape"):
        gaussian(2, "x", (4, 5), out=torch.empty(20))


def test_gaussian_chunks_are_the_definition():
    n = 2 * CHUNK_SIZE + 17
    x = gaussian(3, "big", (n,))
    ts = tensor_seed(3, "big")
    assert torch.equal(x[:CHUNK_SIZE], fill_chunk(ts, 0, torch.empty(CHUNK_SIZE)))
    assert torch.equal(x[2 * CHUNK_SIZE :], fill_chunk(ts, 2, torch.empty(17)))
    # Chunks are independent sub-streams, not copies of each other.
    corr = torch.corrcoef(torch.stack([x[:CHUNK_SIZE], x[CHUNK_SIZE : 2 * CHUNK_SIZE]]))[0, 1].item()
    assert abs(corr) < 0.01
    assert chunk_seed(ts, 0) != chunk_seed(ts, 1)


def test_gaussian_independent_of_thread_count():
    shape = (3 * CHUNK_SIZE + 5,)
    try:
        noise.set_num_threads(1)
        one = gaussian(11, "w", shape)
        noise.set_num_threads(3)
        three = gaussian(11, "w", shape)
    finally:
        noise.set_num_threads(None)
    assert torch.equal(one, three)


def test_identical_across_processes(tmp_path):
    # A fresh interpreter with another PYTHONHASHSEED draws the same noise (and the same seeds).
    path = tmp_path / "noise.pt"
    code = (
        "import torch; from trl_dart_es.noise import gaussian, tensor_seed; "
        f"torch.save((tensor_seed(5, 'emb'), gaussian(77, 'emb', ({CHUNK_SIZE} + 3,))), {str(path)!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, PYTHONHASHSEED="12345"))
    seed, other = torch.load(path)
    assert seed == tensor_seed(5, "emb")
    assert torch.equal(other, gaussian(77, "emb", (CHUNK_SIZE + 3,)))


def test_gaussian_scalar_and_int_shapes():
    assert gaussian(1, "s", ()).shape == ()
    assert gaussian(1, "v", 7).shape == (7,)
    assert np.isfinite(gaussian(1, "v", 7).numpy()).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.cuda
def test_gaussian_cuda_deterministic():
    a = gaussian(4, "w", (1000,), device="cuda")
    assert torch.equal(a, gaussian(4, "w", (1000,), device="cuda"))
    assert a.device.type == "cuda" and abs(a.std().item() - 1) < 0.1
