import json
import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_dart_es.difficulty import DifficultyState
from trl_dart_es.replay import BatchPlanner

IDS = [f"q{i}" for i in range(20)]


def seeded_difficulty(pbar: dict[str, float], **kwargs) -> DifficultyState:
    """A difficulty state whose buffer holds exactly the given problems with the given pass rates."""
    state = DifficultyState(**kwargs)
    state.load_state_dict(
        {
            "pass_rate_ema": pbar,
            "zero_streak": {},
            "visits": {k: 1 for k in pbar},
            "replay_buffer": list(pbar),
        }
    )
    return state


def test_replay_slots_and_steps_per_epoch():
    assert BatchPlanner(IDS, 10, replay_ratio=0.2).num_replay_slots == 2
    assert BatchPlanner(IDS, 10, replay_ratio=0.2, use_replay=False).num_replay_slots == 0
    assert BatchPlanner(IDS, 2, replay_ratio=0.9).num_replay_slots == 1  # round(1.8) = 2, clipped to B - 1
    assert BatchPlanner(IDS, 1, replay_ratio=0.9).num_replay_slots == 0
    planner = BatchPlanner(IDS, 7, replay_ratio=0.3)  # R = round(2.1) = 2, 5 fresh
    assert planner.steps_per_epoch == math.ceil(20 / 5)


def test_validation():
    with pytest.raises(ValueError, match="larger than the train set"):
        BatchPlanner(IDS, 21)
    with pytest.raises(ValueError, match="'q1'"):
        BatchPlanner(["q0", "q1", "q1"], 2)
    with pytest.raises(ValueError, match="replay_ratio"):
        BatchPlanner(IDS, 4, replay_ratio=1.0)
    with pytest.raises(ValueError, match="replay_ratio"):
        BatchPlanner(IDS, 4, replay_ratio=-0.1)
    with pytest.raises(TypeError):
        BatchPlanner([0, 1], 1)


def test_plain_epochs_cover_every_problem_once():
    planner = BatchPlanner(IDS, 5, use_replay=False, seed=3)
    state = DifficultyState()
    seen = []
    for step in range(8):
        batch = planner.next_batch(state)
        assert batch.step == step and batch.num_replayed == 0 and not any(batch.replayed)
        assert len(batch) == 5 and len(set(batch.ids)) == 5
        seen.append(batch.ids)
    assert sorted(sum(seen[:4], [])) == sorted(IDS)  # epoch 0
    assert sorted(sum(seen[4:], [])) == sorted(IDS)  # epoch 1
    assert sum(seen[:4], []) != sum(seen[4:], [])  # reshuffled per epoch
    assert sum(seen[:4], []) != IDS  # and shuffled at all


def test_epoch_rollover_mid_batch_has_no_duplicates():
    ids = [f"p{i}" for i in range(7)]
    planner = BatchPlanner(ids, 3, use_replay=False, seed=0)  # 7 = 3 + 3 + 1: the third batch straddles
    state = DifficultyState()
    order = []
    for _ in range(21):
        batch = planner.next_batch(state)
        assert len(set(batch.ids)) == 3
        order += batch.ids
    counts = Counter(order)
    assert set(counts.values()) == {9}  # 21 steps x 3 = 63 = 9 epochs of 7


def test_replays_only_eligible_and_fill_with_fresh():
    # q0..q3 buffered; q3 is at tau (not eligible). 4 replay slots, at most 3 eligible.
    state = seeded_difficulty({"q0": 0.0, "q1": 0.2, "q2": 0.4, "q3": 0.5})
    planner = BatchPlanner(IDS, 10, replay_ratio=0.4, seed=1)
    batch = planner.next_batch(state)
    replayed = {i for i, r in zip(batch.ids, batch.replayed, strict=True) if r}
    fresh = [i for i, r in zip(batch.ids, batch.replayed, strict=True) if not r]
    assert len(batch) == 10 and len(set(batch.ids)) == 10
    assert replayed <= {"q0", "q1", "q2"} and batch.num_replayed == len(replayed)
    assert not replayed & set(fresh)
    # Only those not drawn fresh this step could be replayed, and all of them were (3 eligible < 4 slots).
    assert replayed == {"q0", "q1", "q2"} - set(fresh)


def test_cooldown_and_max_replays_per_epoch():
    ids = [f"p{i}" for i in range(40)]
    state = seeded_difficulty({"p0": 0.1})
    planner = BatchPlanner(ids, 5, replay_ratio=0.2, replay_cooldown=1, max_replays_per_epoch=2, seed=0)
    log = []  # (step, epoch, "replay" | "fresh")
    for _ in range(14):
        batch = planner.next_batch(state)
        if "p0" in batch.ids:
            log.append(
                (batch.step, batch.epoch, "replay" if batch.replayed[batch.ids.index("p0")] else "fresh")
            )
    fresh0 = [s for s, e, kind in log if e == 0 and kind == "fresh"]
    replays0 = [s for s, e, kind in log if e == 0 and kind == "replay"]
    assert len(fresh0) == 1
    # p0 is eligible whenever it is not fresh, 2+ steps after its last replay, and < 2 replays this epoch.
    first = 0 if fresh0[0] != 0 else 1
    second = first + 2 if fresh0[0] != first + 2 else first + 3
    assert replays0 == [first, second]
    # Slots p0 can no longer fill take fresh problems, so the epoch ends early; the new epoch resets the count.
    assert any(e == 1 and kind == "replay" for _, e, kind in log)
    assert planner.epoch >= 1


def test_replay_probability_follows_exp_minus_kappa_pbar():
    # One slot, two eligible problems: P(pick a) = 1 / (1 + exp(-3 * 0.4)) = 0.7685.
    state = seeded_difficulty({"a": 0.0, "b": 0.4})
    ids = ["a", "b"] + [f"f{i}" for i in range(8)]
    picks = Counter()
    for seed in range(600):
        planner = BatchPlanner(ids, 2, replay_ratio=0.5, seed=seed)
        batch = planner.next_batch(state)
        picks.update(i for i, r in zip(batch.ids, batch.replayed, strict=True) if r)
    p_a = picks["a"] / (picks["a"] + picks["b"])
    expected = 1 / (1 + math.exp(-1.2))
    n = picks["a"] + picks["b"]
    assert n > 450  # a or b is only sometimes drawn fresh
    assert abs(p_a - expected) < 4 * math.sqrt(expected * (1 - expected) / n)


def test_state_dict_resumes_exact_sequence():
    rng = np.random.default_rng(0)

    def run(planner, state, steps):
        out = []
        for _ in range(steps):
            batch = planner.next_batch(state)
            state.update(batch.ids, rng.integers(0, 2, size=(4, len(batch.ids))))
            out.append((batch.ids, batch.replayed, batch.epoch))
        return out

    planner, state = BatchPlanner(IDS, 6, replay_ratio=0.5, seed=4), DifficultyState()
    run(planner, state, 5)
    saved = json.loads(json.dumps({"planner": planner.state_dict(), "difficulty": state.state_dict()}))
    rng_state = rng.bit_generator.state
    expected = run(planner, state, 8)

    rng.bit_generator.state = rng_state
    planner2, state2 = BatchPlanner(IDS, 6, replay_ratio=0.5, seed=4), DifficultyState()
    planner2.load_state_dict(saved["planner"])
    state2.load_state_dict(saved["difficulty"])
    assert run(planner2, state2, 8) == expected
    assert any(n for _, flags, _ in expected for n in flags)  # the check covered replays
    with pytest.raises(ValueError, match="seed"):
        BatchPlanner(IDS, 6, seed=5).load_state_dict(saved["planner"])


# ----------------------------------------------------------------------------------------- properties
@settings(max_examples=60, deadline=None)
@given(
    n_ids=st.integers(4, 15),
    batch_frac=st.floats(0.2, 1.0),
    ratio=st.floats(0.0, 0.9),
    cooldown=st.integers(0, 3),
    max_replays=st.integers(0, 3),
    tau=st.floats(0.1, 1.0),
    seed=st.integers(0, 2**16),
)
def test_every_replay_was_eligible(n_ids, batch_frac, ratio, cooldown, max_replays, tau, seed):
    ids = [f"i{k}" for k in range(n_ids)]
    b = max(1, int(batch_frac * n_ids))
    planner = BatchPlanner(
        ids, b, replay_ratio=ratio, replay_cooldown=cooldown, max_replays_per_epoch=max_replays, seed=seed
    )
    state = DifficultyState(replay_pass_threshold=tau)
    rng = np.random.default_rng(seed)
    last: dict[str, int] = {}
    count: dict[str, int] = {}
    epoch = 0
    for _ in range(12):
        before = planner.state_dict()
        if len(before["order"]) < planner.num_fresh:  # the fresh draw itself starts a new epoch
            count = {}
        buffer = state.replay_buffer
        batch = planner.next_batch(state)
        assert len(batch.ids) == b and len(set(batch.ids)) == b
        assert batch.num_replayed == sum(batch.replayed) <= planner.num_replay_slots
        fresh = {i for i, r in zip(batch.ids, batch.replayed, strict=True) if not r}
        for pid, rep in zip(batch.ids, batch.replayed, strict=True):
            if not rep:
                continue
            assert pid in buffer and pid not in fresh
            assert state.pass_rate(pid) < tau
            assert count.get(pid, 0) < max_replays
            assert pid not in last or batch.step - last[pid] > cooldown
            count[pid] = count.get(pid, 0) + 1
            last[pid] = batch.step
        if batch.epoch != epoch:
            epoch = batch.epoch
            if len(before["order"]) >= planner.num_fresh:  # rolled over while filling: reset after
                count = {}
        # Pass rates near 0.3 keep problems in the buffer, so replay really happens.
        state.update(batch.ids, (rng.random((5, b)) < 0.3).astype(int))
