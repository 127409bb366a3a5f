"""Low-rank (EGGROLL) perturbations: the batched population forward equals materialised weights, the update
equals an fp64 reference, the factors are deterministic, and the trainer trains and resumes with them."""

import json

import numpy as np
import pytest
import torch
from conftest import length_reward, make_tiny_llama, parity_reward, tiny_es_config, toy_dataset
from torch import nn

from trl_dart_es import DartESConfig, DartESTrainer
from trl_dart_es.lowrank import LowRankParameters, lora_carried_names, select_by_module
from trl_dart_es.noise import Member, gaussian, population
from trl_dart_es.rollout.lowrank import LowRankRollout
from trl_dart_es.rollout.transformers import (
    TransformersRollout,
    build_generation_config,
    greedy_generation_config,
)


def tiny(tied: bool, vocab_size=128, hidden=32, layers=2, dtype=torch.float32):
    model = make_tiny_llama(vocab_size=vocab_size, hidden=hidden, layers=layers, dtype=dtype)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def members_of(n=4, antithetic=False, step_seed=3):
    return population(step_seed, n, antithetic=antithetic)


# ------------------------------------------------------------------------------------ parameter layout
def test_matrices_lowrank_vectors_fullrank_and_tied_once():
    model = tiny(tied=True)
    params = LowRankParameters(model, 0.1, rank=2)
    assert "lm_head.weight" not in params.names  # tied to the embedding: one parameter, one perturbation
    assert "model.embed_tokens.weight" in params.lowrank_names
    assert all(model.get_parameter(n).dim() == 2 for n in params.lowrank_names)
    assert all(model.get_parameter(n).dim() == 1 for n in params.fullrank_names)
    assert params.num_parameters == sum(p.numel() for p in model.parameters())
    untied = LowRankParameters(tiny(tied=False), 0.1)
    assert "lm_head.weight" in untied.lowrank_names


def test_validation_errors():
    with pytest.raises(ValueError, match="sigma"):
        LowRankParameters(tiny(False), 0.0)
    with pytest.raises(ValueError, match="rank"):
        LowRankParameters(tiny(False), 0.1, rank=0)
    with pytest.raises(ValueError, match="trainable"):
        LowRankParameters(tiny(False).requires_grad_(False), 0.1)
    with pytest.raises(TypeError, match="Member"):
        LowRankParameters(tiny(False), 0.1).perturb(7)


# ------------------------------------------------------------------------------------ proof 3: factors
def test_factors_are_deterministic_and_independent_across_tensors_and_seeds():
    a = LowRankParameters(tiny(False), 0.1, rank=3)
    b = LowRankParameters(tiny(False), 0.1, rank=3)
    m1, m2 = Member(11), Member(12)
    q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"  # both 32x32
    qa, qb = a.factors(m1, q)
    assert qa.shape == (32, 3) and qb.shape == (32, 3) and qa.dtype == torch.float32
    # Same (seed, name): same factors in another instance, drawn in another order, whatever the sign.
    b.factors(m1, o)
    for x, y in zip(a.factors(m1, q), b.factors(Member(11, -1), q), strict=True):
        assert torch.equal(x, y)
    # The definition: gaussian(seed, name, (r, m + n)) split into A^T and B^T.
    raw = gaussian(11, q, (3, 64))
    assert torch.equal(qa, raw[:, :32].T) and torch.equal(qb, raw[:, 32:].T)
    # Same shape, other tensor or other seed: unrelated factors (not equal, not correlated).
    for other in (a.factors(m1, o)[0], a.factors(m2, q)[0]):
        assert not torch.equal(qa, other)
        corr = np.corrcoef(qa.flatten().numpy(), other.flatten().numpy())[0, 1]
        assert abs(corr) < 0.35  # 96 pairs: |corr| of independent draws is < 0.35 with p > 0.999


def test_lowrank_noise_has_unit_variance_per_entry():
    model = nn.Sequential(nn.Linear(256, 256, bias=False))
    for rank in (1, 4):
        params = LowRankParameters(model, 1.0, rank=rank)
        w0 = model[0].weight.detach().clone()
        with params.perturbed(Member(5)):
            eps = model[0].weight.detach() - w0
        a, b = params.factors(Member(5), "0.weight")
        torch.testing.assert_close(eps, a @ b.T / rank**0.5, rtol=1e-5, atol=1e-5)
        assert 0.9 < float(eps.var()) < 1.1  # sigma = 1: entries of A B^T / sqrt(r) have variance 1
        assert torch.linalg.matrix_rank(eps.double(), rtol=1e-4) == rank  # up to fp32 rounding of W + eps


# -------------------------------------------------------------------------- perturb / restore (exact)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_perturb_and_restore_are_bitwise_exact(dtype):
    model = tiny(True, dtype=dtype)
    before = snapshot(model)
    params = LowRankParameters(model, 0.05, rank=2)
    params.perturb(Member(1))
    params.perturb(Member(2, -1))  # member to member without restore
    assert params.is_perturbed
    assert not torch.equal(model.model.embed_tokens.weight, before["model.embed_tokens.weight"])
    assert not torch.equal(model.model.norm.weight, before["model.norm.weight"])  # vectors move too
    params.restore()
    assert not params.is_perturbed
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_reference_mode_restores_in_fp32():
    model = tiny(False)
    before = snapshot(model)
    params = LowRankParameters(model, 0.05, exact_restore=False)
    with params.perturbed(Member(1)):
        pass
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, before[n], rtol=0, atol=1e-6)


# --------------------------------------------------------------------- proof 1: batched == materialised
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("rank", [1, 3])
def test_batched_forward_equals_materialised_weights_row_by_row(tied, rank):
    model = tiny(tied)
    params = LowRankParameters(model, 0.05, rank=rank)
    members = members_of(4, antithetic=True)  # signs matter too
    ids = torch.randint(3, 128, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # a left-padded row
    before = snapshot(model)
    with torch.no_grad():
        with params.batched(members):
            batched = model(ids.repeat(4, 1), attention_mask=mask.repeat(4, 1)).logits
        for n, p in model.named_parameters():  # the weights were never written
            assert torch.equal(p, before[n]), n
        base = model(ids, attention_mask=mask).logits
        for g, member in enumerate(members):
            with params.perturbed(member):
                ref = model(ids, attention_mask=mask).logits
            assert (ref - base).abs().max() > 1e-2  # the perturbation is visible ...
            torch.testing.assert_close(batched[3 * g : 3 * g + 3], ref, rtol=1e-4, atol=2e-5)  # ... and equal


def test_batched_forward_with_peft_adapter():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny(False), LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    ).eval()
    params = LowRankParameters(model, 0.05, rank=1)
    assert params.names and all("lora_" in n for n in params.names)  # ES moves only the adapter
    members = members_of(3)
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with params.batched(members):
            batched = model(input_ids=ids.repeat(3, 1)).logits
        base = model(input_ids=ids).logits
        assert (batched[:2] - base).abs().max() > 1e-4  # the adapter's perturbation shows
        for g, member in enumerate(members):
            with params.perturbed(member):
                torch.testing.assert_close(
                    batched[2 * g : 2 * g + 2], model(input_ids=ids).logits, rtol=1e-4, atol=2e-5
                )


class _Toy(nn.Module):
    """Embedding, LayerNorm (weight and bias) and biased Linear layers: the other supported module kinds."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 12)
        self.norm = nn.LayerNorm(12)
        self.fc = nn.Linear(12, 20)
        self.out = nn.Linear(20, 7)

    def forward(self, ids):
        return self.out(torch.tanh(self.fc(self.norm(self.emb(ids)))))


def test_batched_forward_layernorm_and_biases():
    model = _Toy()
    params = LowRankParameters(model, 0.1, rank=2)
    assert set(params.fullrank_names) == {"norm.weight", "norm.bias", "fc.bias", "out.bias"}
    members = members_of(3)
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with params.batched(members):
            batched = model(ids.repeat(3, 1))
        for g, member in enumerate(members):
            with params.perturbed(member):
                torch.testing.assert_close(batched[2 * g : 2 * g + 2], model(ids), rtol=1e-5, atol=1e-6)


def test_batched_cleans_up_after_errors_and_refuses_bad_layouts():
    model = tiny(False)
    params = LowRankParameters(model, 0.05)
    norm = model.model.norm
    original = norm.weight
    with pytest.raises(RuntimeError, match="split evenly"), torch.no_grad(), params.batched(members_of(3)):
        model(torch.ones(4, 3, dtype=torch.long))  # 4 rows for 3 members
    assert norm.weight is original
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    with params.perturbed(Member(1)), pytest.raises(RuntimeError, match="restore"):
        with params.batched(members_of(2)):
            pass


def test_unsupported_modules_are_refused_by_name():
    class Scaled(nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 2.0

    model = nn.Sequential(Scaled(10, 4), nn.Conv1d(4, 4, 1))
    params = LowRankParameters(model, 0.1)
    with pytest.raises(NotImplementedError, match=r"'Conv1d\.weight', 'Scaled\.weight'"):
        params.check_batchable()
    with pytest.raises(NotImplementedError, match="Conv1d.bias"), params.batched(members_of(2)):
        pass
    # Frozen parameters need no hook.
    model[1].requires_grad_(False)
    model[0].requires_grad_(False)
    model.add_module("fc", nn.Linear(4, 4))
    LowRankParameters(model, 0.1).check_batchable()


# ------------------------------------------------------------------------ proof 1: greedy generation
def _prompts():
    return [
        [{"role": "user", "content": "What is 2 + 3?"}],
        [{"role": "user", "content": "Name a colour."}],
        [{"role": "user", "content": "Count to five, please, slowly and carefully."}],
        [{"role": "user", "content": "Hi"}],
    ]


def _gen_config(tokenizer, length=5):
    args = DartESConfig("unused", max_completion_length=length, use_cpu=True, report_to="none")
    return build_generation_config(args, tokenizer, [tokenizer.eos_token_id])


def test_greedy_helper_matches_the_trainers_greedy_settings(tokenizer):
    """The benchmarks' and parity tests' greedy config decodes exactly as the trainer's temperature-0 config."""
    trainer_gc, helper_gc = _gen_config(tokenizer, 7), greedy_generation_config(tokenizer, 7)
    keys = ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "eos_token_id", "pad_token_id")
    assert {k: getattr(helper_gc, k) for k in keys} == {k: getattr(trainer_gc, k) for k in keys}
    assert helper_gc.do_sample is False and helper_gc.eos_token_id == [tokenizer.eos_token_id]
    assert greedy_generation_config(tokenizer, 7, min_new_tokens=7).min_new_tokens == 7


@pytest.mark.parametrize("tied,batch_size", [(False, None), (True, 3), (True, 8)])
def test_generate_population_equals_per_member_generation_with_materialised_weights(
    tokenizer, tied, batch_size
):
    model = tiny(tied, vocab_size=len(tokenizer), hidden=16, layers=1)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    params = LowRankParameters(model, 0.5, rank=2)
    config = _gen_config(tokenizer)
    members = members_of(3)
    lowrank = LowRankRollout(model, tokenizer, config, params, batch_size=batch_size)
    # B = 4 prompts: batch_size 3 -> slices of one member's prompts; 8 -> two whole members per call.
    reference_batch = 3 if batch_size == 3 else None
    materialised = TransformersRollout(model, tokenizer, config, params, batch_size=reference_batch)
    got = lowrank.generate_population(_prompts(), members)
    want = materialised.generate_population(_prompts(), members)  # perturb(member) + generate, per member
    assert not params.is_perturbed
    assert len(got) == len(members)
    assert len({tuple(map(tuple, g.token_ids)) for g in want}) > 1  # members really generate differently
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids and g.texts == w.texts
    if batch_size is None:  # generate() is the plain model: no hooks left behind.
        assert lowrank.generate(_prompts()).token_ids == materialised.generate(_prompts()).token_ids


def test_rollout_plan_keeps_member_blocks_whole(tokenizer):
    params = LowRankParameters(tiny(False), 0.1)
    config = _gen_config(tokenizer)
    plan = LowRankRollout(tiny(False), tokenizer, config, params, batch_size=20).plan(8, 5)
    assert plan == [(slice(0, 2), slice(0, 8)), (slice(2, 4), slice(0, 8)), (slice(4, 5), slice(0, 8))]
    plan = LowRankRollout(tiny(False), tokenizer, config, params, batch_size=3).plan(8, 2)
    assert [(m.start, p.start, p.stop) for m, p in plan] == [
        (0, 0, 3),
        (0, 3, 6),
        (0, 6, 8),
        (1, 0, 3),
        (1, 3, 6),
        (1, 6, 8),
    ]
    assert LowRankRollout(tiny(False), tokenizer, config, params).plan(8, 5) == [(slice(0, 5), slice(0, 8))]
    with pytest.raises(TypeError, match="LowRankParameters"):
        LowRankRollout(tiny(False), tokenizer, config, object())


# ----------------------------------------------------------------------------- proof 2: the update
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [1, 2])
def test_update_equals_fp64_reference_from_factors(dtype, rank):
    model = tiny(True, dtype=dtype)
    params = LowRankParameters(model, 0.05, rank=rank)
    master0 = {n: p.detach().double() for n, p in model.named_parameters()}
    members = members_of(6, antithetic=True)  # pairs share a seed: combined before the matmul
    z = [0.9, -1.3, 0.2, 0.0, 1.7, -0.4]
    lr = 0.02
    expected = {}
    for n in params.names:
        delta = torch.zeros_like(master0[n])
        for m, zn in zip(members, z, strict=True):
            if n in params.lowrank_names:
                a, b = params.factors(m, n)
                eps = a.double() @ b.double().T / rank**0.5
            else:
                eps = gaussian(m.seed, n, master0[n].shape).double()
            delta += zn * m.sign * eps
        expected[n] = lr / len(members) * delta
    params.perturb(members[1])  # update() restores first
    norm = params.update(members, z, lr)
    assert not params.is_perturbed and params._factor_cache == {}
    master = params.master_state_dict() if dtype != torch.float32 else dict(model.named_parameters())
    for n in params.names:
        got = master[n].detach().double() - master0[n]
        torch.testing.assert_close(got, expected[n], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(model.get_parameter(n), master[n].to(dtype), rtol=0, atol=0)
    ref_norm = float(torch.sqrt(sum((e**2).sum() for e in expected.values())))
    assert norm == pytest.approx(ref_norm, rel=1e-4)


def test_fp32_master_keeps_updates_below_bf16_resolution_and_round_trips():
    model = tiny(False, dtype=torch.bfloat16)
    params = LowRankParameters(model, 0.05)
    norm_gain = model.model.norm.weight.detach().clone()  # 1.0: bf16 spacing there is 2**-7
    members = members_of(2)
    for _ in range(3):
        params.update(members, [1.0, -1.0], 1e-4)
    state = params.master_state_dict()
    assert set(state) == set(params.names) and all(v.dtype == torch.float32 for v in state.values())
    assert not torch.equal(state["model.norm.weight"], norm_gain.float())  # the master moved ...
    assert torch.equal(model.model.norm.weight, norm_gain)  # ... below what bf16 can show
    other = LowRankParameters(tiny(False, dtype=torch.bfloat16), 0.05)
    other.load_master_state_dict(state)
    for n, v in other.master_state_dict().items():
        assert torch.equal(v, state[n]), n
    with pytest.raises(ValueError, match="missing"):
        other.load_master_state_dict({})


def _master_bytes(params) -> int:
    return sum(b.numel() * b.element_size() for b in params._mat_base if b is not None)


def test_fp32_matrices_get_a_master_copy_only_when_a_member_is_materialised():
    """The batched and vLLM rollouts never materialise a member: an fp32 model then holds no second copy of its
    matrices, and its updates are bitwise those of a run that made the copy (perturb + restore) first."""
    lazy_model, eager_model = tiny(True), tiny(True)
    lazy, eager = LowRankParameters(lazy_model, 0.05, rank=2), LowRankParameters(eager_model, 0.05, rank=2)
    assert _master_bytes(lazy) == 0
    with eager.perturbed(Member(9)):
        pass
    assert _master_bytes(eager) == 4 * sum(p.numel() for p in eager._mats)
    for step in range(3):
        members = members_of(4, antithetic=True, step_seed=step)
        assert lazy.update(members, [1.0, -0.5, 0.25, 2.0], 1e-2) == eager.update(
            members, [1.0, -0.5, 0.25, 2.0], 1e-2
        )
    assert _master_bytes(lazy) == 0
    for (n, a), b in zip(lazy_model.named_parameters(), eager_model.parameters(), strict=True):
        assert torch.equal(a, b), n
    before = snapshot(lazy_model)  # the first materialised member makes the copy, and restore is still exact
    with lazy.perturbed(Member(5, -1)):
        assert not torch.equal(lazy_model.model.embed_tokens.weight, before["model.embed_tokens.weight"])
    assert _master_bytes(lazy) == _master_bytes(eager)
    for n, p in lazy_model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert all(b is not None for b in LowRankParameters(tiny(False, dtype=torch.bfloat16), 0.05)._mat_base)


def test_mixed_precision_master_weights_round_trip_without_copying_the_fp32_matrices():
    """fp32 matrices beside a bf16 norm: the checkpoint's masters include the matrices as they are, and loading
    them makes no copy either."""
    model = tiny(False)
    model.model.norm.to(torch.bfloat16)
    params = LowRankParameters(model, 0.05)
    params.update(members_of(2), [1.0, -1.0], 1e-2)
    state = params.master_state_dict()
    assert set(state) == set(params.names) and _master_bytes(params) == 0
    for n in params.lowrank_names:
        assert torch.equal(state[n], model.get_parameter(n)), n
    other_model = tiny(False)
    other_model.model.norm.to(torch.bfloat16)
    other = LowRankParameters(other_model, 0.05)
    other.load_master_state_dict(state)
    assert _master_bytes(other) == 0
    for (n, a), b in zip(other_model.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), n


# ------------------------------------------------------------------------------------------ trainer
def _lowrank_trainer(out, tokenizer, **kw):
    model = make_tiny_llama(vocab_size=len(tokenizer), hidden=16, layers=1)
    model.config.tie_word_embeddings = True  # like SmolLM2
    model.lm_head.weight = model.model.embed_tokens.weight
    args = tiny_es_config(
        out, per_device_train_batch_size=3, perturbation="lowrank", perturbation_rank=2, **kw
    )
    return DartESTrainer(
        model, [parity_reward, length_reward], args, toy_dataset(), processing_class=tokenizer
    )


def test_trainer_trains_with_lowrank_population_batching(tmp_path, tokenizer):
    trainer = _lowrank_trainer(tmp_path / "out", tokenizer)
    assert isinstance(trainer.es_params, LowRankParameters) and trainer.es_params.rank == 2
    assert isinstance(trainer.rollout, LowRankRollout)
    calls = {"n": 0}
    original = trainer.model.generate

    def counting(*args, **kwargs):
        calls["n"] += 1
        assert kwargs["input_ids"].shape[0] == 4 * 3  # N x B rows in one call
        return original(*args, **kwargs)

    trainer.model.generate = counting
    before = snapshot(trainer.model)
    trainer.train()
    assert calls["n"] == 2  # one generate call per ES step
    assert trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight  # still tied
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert "model.embed_tokens.weight" in changed and "model.norm.weight" in changed
    assert all(log["update_norm"] > 0 for log in trainer.state.log_history[:2])


def test_select_by_module_matches_the_owning_module_like_peft():
    names = lora_carried_names(make_tiny_llama())
    mlp = select_by_module(names, ["gate_proj", "up_proj", "down_proj"])
    assert mlp == [n for n in names if ".mlp." in n] and len(mlp) == 2 * 3  # 2 layers x 3 projections
    assert select_by_module(["model.norm.weight", "x.weight"], {"norm"}) == ["model.norm.weight"]
    with pytest.raises(ValueError, match=r"\['dense'\] match no evolvable tensor"):
        select_by_module(names, ["down_proj", "dense"])


def test_trainer_evolves_only_the_target_modules(tmp_path, tokenizer):
    trainer = _lowrank_trainer(tmp_path / "out", tokenizer, lowrank_target_modules=["down_proj", "o_proj"])
    assert trainer.es_params.fullrank_names == []
    before = snapshot(trainer.model)
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {"model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight"}
    with pytest.raises(ValueError, match="lowrank_target_modules"):
        _lowrank_trainer(tmp_path / "bad", tokenizer, lowrank_target_modules=["downproj"])


def test_config_validates_lowrank_target_modules(tmp_path):
    cfg = tiny_es_config(tmp_path, perturbation="lowrank", lowrank_target_modules="down_proj")
    assert cfg.lowrank_target_modules == ["down_proj"]  # one name on the command line: a list of one
    with pytest.raises(ValueError, match="lowrank_target_modules=\\['down_proj'\\].*perturbation='lowrank'"):
        tiny_es_config(tmp_path, lowrank_target_modules=["down_proj"])
    with pytest.raises(ValueError, match="lowrank_target_modules"):
        tiny_es_config(tmp_path, perturbation="lowrank", lowrank_target_modules=[])
    assert "help" in DartESConfig.__dataclass_fields__["lowrank_target_modules"].metadata


@pytest.mark.slow
def test_trainer_lowrank_resume_is_bitwise_equal_to_uninterrupted_run(tmp_path, tokenizer):
    def run(out, max_steps, resume=None):
        trainer = _lowrank_trainer(
            tmp_path / out, tokenizer, max_steps=max_steps, save_strategy="steps", save_steps=2
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run("a", 4)
    run("b", 2)
    resumed = run("b", 4, resume=str(tmp_path / "b" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    a, b = snapshot(straight.model), snapshot(resumed.model)
    for n in a:
        assert torch.equal(a[n], b[n]), n
    assert json.dumps(straight.strategy.state_dict(), sort_keys=True) == json.dumps(
        resumed.strategy.state_dict(), sort_keys=True
    )
