"""The untrained embedded model's held-out metrics are cached, keyed by what changes them."""

import pytest
from conftest import tiny_es_config

from trl_dart_es import DartESTrainer
from trl_dart_es.rewards import gsm8k_accuracy_reward, gsm8k_format_reward
from trl_dart_es.tasks import load_task_dataset
from trl_dart_es.trainer.baseline import baseline_cache_key, evaluate_untrained

EMBEDDED = "embedded:smollm2-135m"


@pytest.fixture(scope="module")
def trainer_and_data(tmp_path_factory):
    """One trainer on the embedded model for the module: loading it is most of each test's time."""
    data = load_task_dataset("embedded:gsm8k", "test", num_examples=4)
    out = tmp_path_factory.mktemp("baseline") / "out"
    args = tiny_es_config(out, max_completion_length=4, per_device_eval_batch_size=4)
    trainer = DartESTrainer(EMBEDDED, [gsm8k_accuracy_reward, gsm8k_format_reward], args, data)
    return trainer, data


def test_untrained_metrics_are_cached_by_everything_that_changes_them(tmp_path, trainer_and_data):
    cache = tmp_path / "cache"
    trainer, data = trainer_and_data
    first, cached = evaluate_untrained(trainer, data, "embedded:smollm2-135m", cache_dir=cache)
    assert not cached and len(list(cache.glob("*.json"))) == 1
    again, cached = evaluate_untrained(trainer, data, "embedded:smollm2-135m", cache_dir=cache)
    assert cached and again == pytest.approx(first)
    assert again == pytest.approx(trainer.evaluate_dataset(data))  # the cache holds the real evaluation

    # Other rows are evaluated anew.
    _, cached = evaluate_untrained(trainer, data.select([0, 1]), "embedded:smollm2-135m", cache_dir=cache)
    assert not cached
    # The key covers the generation settings (here the completion length) and the evaluation rows.
    key = baseline_cache_key(trainer, data, "embedded:smollm2-135m")
    trainer.args.max_completion_length += 1
    assert baseline_cache_key(trainer, data, "embedded:smollm2-135m") != key
    trainer.args.max_completion_length -= 1
    assert baseline_cache_key(trainer, data, "embedded:smollm2-135m") == key
    assert len(list(cache.glob("*.json"))) == 2

    # A model that is not embedded (its weights may change) is never cached.
    _, cached = evaluate_untrained(trainer, data, "some-org/some-model", cache_dir=cache)
    assert not cached and len(list(cache.glob("*.json"))) == 2


def test_untrained_solved_rows_are_cached_with_the_metrics(tmp_path, trainer_and_data):
    """The recipe's paired interval needs the untrained model's per-row flags: cached with the metrics, and a
    file written without them (an older cache) is evaluated anew for a caller that needs them."""
    import json

    cache = tmp_path / "cache"
    trainer, data = trainer_and_data
    metrics, solved, cached = evaluate_untrained(trainer, data, EMBEDDED, cache_dir=cache, return_solved=True)
    assert (
        not cached
        and solved.shape == (len(data),)
        and solved.mean() == pytest.approx(metrics["eval_accuracy"])
    )
    again, solved_again, cached = evaluate_untrained(
        trainer, data, EMBEDDED, cache_dir=cache, return_solved=True
    )
    assert cached and again == pytest.approx(metrics) and solved_again.tolist() == solved.tolist()
    (path,) = cache.glob("*.json")
    path.write_text(json.dumps(metrics))  # as written before the flags were stored
    assert evaluate_untrained(trainer, data, EMBEDDED, cache_dir=cache)[1]  # enough for metrics alone
    *_, cached = evaluate_untrained(trainer, data, EMBEDDED, cache_dir=cache, return_solved=True)
    assert not cached and "solved_rows" in json.loads(path.read_text())
