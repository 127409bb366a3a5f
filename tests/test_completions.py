"""What training reports, the TRL way: GRPO's metric names with values computed from the rollouts, the
completions table (console, parquet, trackers), and trackio / TensorBoard / wandb runs read back from disk."""

import glob
import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import length_reward, parity_reward, tiny_es_config, toy_dataset

from trl_dart_es import DartES, DartESTrainer
from trl_dart_es.rollout.base import Generation
from trl_dart_es.trainer.completions import StepCompletions, completions_markdown, frac_reward_zero_std

MAX_TOKENS = 6


# ------------------------------------------------------------------------------------------------ helpers
class ShapedRollouts:
    """Wraps a trainer's rollout so that a step has every case the metrics must handle, and records it all.

    Completion (member n, problem j) is cut to k = (n + 2j) % (MAX_TOKENS + 1) tokens and ended with EOS (k =
    MAX_TOKENS: left as generated, clipped), so lengths vary and some completions terminate; every member's answer
    to an even-numbered problem is member 0's, so those problems score the same for every member (zero std).
    """

    def __init__(self, trainer, tokenizer, monkeypatch):
        self.tokenizer = tokenizer
        self.steps: list[dict] = []
        self.generate = trainer.rollout.generate_population
        monkeypatch.setattr(trainer.rollout, "generate_population", self._generate_population)
        # On the class: the trainer snapshots the strategy's attributes before each step.
        tell = DartES.tell

        def record_tell(strategy, batch, rewards):
            result = tell(strategy, batch, rewards)
            self.steps[-1].update(batch=batch, result=result)
            return result

        monkeypatch.setattr(DartES, "tell", record_tell)

    def _cut(self, ids: list[int], k: int) -> list[int]:
        return list(ids) if k == MAX_TOKENS else list(ids[:k]) + [self.tokenizer.eos_token_id]

    def _generate_population(self, prompts, members):
        raw = self.generate(prompts, members)
        token_ids = [
            [self._cut(g.token_ids[j], (n + 2 * j) % (MAX_TOKENS + 1)) for j in range(len(prompts))]
            for n, g in enumerate(raw)
        ]
        for n in range(1, len(raw)):
            for j in range(0, len(prompts), 2):
                token_ids[n][j] = token_ids[0][j]
        gens = [
            Generation(
                texts=[self.tokenizer.decode(ids, skip_special_tokens=True) for ids in rows], token_ids=rows
            )
            for rows in token_ids
        ]
        self.steps.append({"prompts": list(prompts), "members": list(members), "gens": gens})
        return gens


def _expected_rewards(gens: list[Generation]) -> np.ndarray:
    """K×N×B rewards of the recorded completions, from the reward functions themselves."""
    parity = [parity_reward(g.token_ids) for g in gens]
    length = [length_reward([[{"role": "assistant", "content": t}] for t in g.texts]) for g in gens]
    return np.asarray([parity, length], dtype=np.float64)


def _trainer(tmp_path, tokenizer, tiny_lm, monkeypatch, **kw):
    args = tiny_es_config(tmp_path / "out", max_completion_length=MAX_TOKENS, logging_steps=1, **kw)
    trainer = DartESTrainer(
        model=tiny_lm,
        reward_funcs=[parity_reward, length_reward],
        args=args,
        train_dataset=toy_dataset(8),
        processing_class=tokenizer,
    )
    return trainer, ShapedRollouts(trainer, tokenizer, monkeypatch)


def _train_logs(trainer) -> list[dict]:
    return [log for log in trainer.state.log_history if "reward" in log]


# ------------------------------------------------------------------------------------- pure computations
def test_length_metrics_and_zero_std_fraction_on_known_values():
    completions = StepCompletions(
        lengths=np.array([[3, 6, 1], [6, 2, 6]]),
        clipped=np.array([[False, True, False], [True, False, True]]),
        texts=None,
    )
    m = completions.metrics()
    assert (m["completions/mean_length"], m["completions/min_length"], m["completions/max_length"]) == (
        4.0,
        1,
        6,
    )
    assert m["completions/clipped_ratio"] == pytest.approx(3 / 6)
    assert m["completions/mean_terminated_length"] == pytest.approx(2.0)
    assert (m["completions/min_terminated_length"], m["completions/max_terminated_length"]) == (1, 3)
    every_clipped = StepCompletions(np.full((2, 2), 6), np.ones((2, 2), dtype=bool), None).metrics()
    assert every_clipped["completions/mean_terminated_length"] == 0.0  # GRPO's value, not NaN
    # problem 0: every member 1.0; problem 1: differ; problem 2: every member 0.1 (sums equal up to rounding)
    total = np.array([[1.0, 0.0, 0.1], [1.0, 1.0, 0.3 - 0.2]])
    assert frac_reward_zero_std(total) == pytest.approx(2 / 3)


def test_markdown_escapes_cells_and_has_one_line_per_row():
    table = {
        "step": [1, 1],
        "member": [0, 1],
        "member_seed": [11, 12],
        "prompt": [[{"role": "system", "content": "s"}, {"role": "user", "content": "a|b"}], "plain\nprompt"],
        "completion": ["x", "y"],
        "r": [0.5, float("nan")],
        "advantage": [1.0, -1.0],
    }
    lines = completions_markdown(table, ["r"]).splitlines()
    assert len(lines) == 2 + 2
    assert lines[0] == "| step | member | member_seed | prompt | completion | r | advantage |"
    assert "system: s<br>user: a\\|b" in lines[2] and "plain<br>prompt" in lines[3] and "| nan |" in lines[3]


# ------------------------------------------------------------------------------------ metrics of a run
def test_step_metrics_and_parquet_rows_match_the_rollouts(tmp_path, tiny_lm, tokenizer, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "240")  # rich's console width: headers in full
    trainer, shaped = _trainer(
        tmp_path, tokenizer, tiny_lm, monkeypatch, log_completions=True, num_completions_to_print=3
    )
    trainer.train()
    logs = _train_logs(trainer)
    assert len(logs) == len(shaped.steps) == 2
    seen_tokens = 0
    for step, (log, rec) in enumerate(zip(logs, shaped.steps, strict=True), start=1):
        gens, members, result, batch = rec["gens"], rec["members"], rec["result"], rec["batch"]
        lengths = np.array([[len(ids) for ids in g.token_ids] for g in gens])
        ends_with_eos = np.array(
            [[bool(ids) and ids[-1] == tokenizer.eos_token_id for ids in g.token_ids] for g in gens]
        )
        clipped = (lengths >= MAX_TOKENS) & ~ends_with_eos
        assert 0 < clipped.sum() < clipped.size  # the shaping gave both kinds
        assert log["completions/mean_length"] == pytest.approx(lengths.mean())
        assert log["completions/min_length"] == lengths.min()
        assert log["completions/max_length"] == lengths.max()
        assert log["completions/clipped_ratio"] == pytest.approx(clipped.mean())
        assert log["completions/mean_terminated_length"] == pytest.approx(lengths[~clipped].mean())
        assert log["completions/min_terminated_length"] == lengths[~clipped].min()
        assert log["completions/max_terminated_length"] == lengths[~clipped].max()

        rewards = _expected_rewards(gens)
        total = rewards[0] + rewards[1]  # reward_weights default to 1.0 each
        zero_std = np.isclose(total.std(axis=0), 0.0).mean()
        assert 0.5 <= zero_std < 1  # even problems by construction, not all
        assert log["frac_reward_zero_std"] == pytest.approx(zero_std)

        # TRL's num_tokens: a running total of prompt and completion tokens; every member reads every prompt.
        prompt_tokens = sum(
            len(
                tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
            )
            for p in rec["prompts"]
        )
        seen_tokens += len(members) * prompt_tokens + lengths.sum()
        assert log["num_tokens"] == seen_tokens
        assert log["step_time"] > 0

        # The parquet file: one row per (member, problem), member-major, every value from this step's rollouts.
        df = pd.read_parquet(tmp_path / "out" / "completions" / f"completions_{step:05d}.parquet")
        n, b = lengths.shape
        assert list(df.columns[:5]) == ["step", "member", "member_seed", "prompt", "completion"]
        assert len(df) == n * b and (df["step"] == step).all()
        assert df["member"].tolist() == [i for i in range(n) for _ in range(b)]
        assert df["member_seed"].tolist() == [m.seed for m in members for _ in range(b)]
        assert df["member_sign"].tolist() == [m.sign for m in members for _ in range(b)]
        assert df["problem_id"].tolist() == list(batch.ids) * n
        prompts = [list(p) for p in df["prompt"]]
        assert [[dict(m) for m in p] for p in prompts] == [
            rec["prompts"][j] for _ in range(n) for j in range(b)
        ]
        assert [c[0]["content"] for c in df["completion"]] == [t for g in gens for t in g.texts]
        np.testing.assert_allclose(df["parity_reward"], rewards[0].ravel())
        np.testing.assert_allclose(df["length_reward"], rewards[1].ravel())
        np.testing.assert_allclose(df["advantage"], np.repeat(result.z, b))
        np.testing.assert_allclose(df["fitness"], np.repeat(result.fitness, b))
        np.testing.assert_allclose(df["difficulty_weight"], np.tile(result.weights, n))
    out = capsys.readouterr().out
    # TRL's rich table at each log, with num_completions_to_print rows (one USER line per row's prompt)
    assert "Step 1" in out and "Step 2" in out and "Advantage" in out and "member" in out
    assert "member_seed" not in out  # in the files only: 19 digits squeeze an 80-column console
    assert out.count("USER") == 2 * 3


def test_completions_print_steps_prints_the_table_only_at_its_multiples(
    tmp_path, tiny_lm, tokenizer, capsys, monkeypatch
):
    """The console gets the table at steps 2 and 4 of 5; every logging step still writes its parquet file."""
    monkeypatch.setenv("COLUMNS", "240")
    trainer, _ = _trainer(
        tmp_path,
        tokenizer,
        tiny_lm,
        monkeypatch,
        max_steps=5,
        log_completions=True,
        num_completions_to_print=1,
        completions_print_steps=2,
    )
    trainer.train()
    out = capsys.readouterr().out
    printed = [step for step in range(1, 6) if f"Step {step} " in out]
    assert printed == [2, 4], out[-2000:]
    files = sorted(p.name for p in (tmp_path / "out" / "completions").glob("*.parquet"))
    assert files == [f"completions_{step:05d}.parquet" for step in range(1, 6)]


def test_completions_print_steps_below_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="completions_print_steps=0"):
        tiny_es_config(tmp_path, completions_print_steps=0)


def test_without_log_completions_nothing_is_written_and_metrics_stay(
    tmp_path, tiny_lm, tokenizer, capsys, monkeypatch
):
    trainer, shaped = _trainer(tmp_path, tokenizer, tiny_lm, monkeypatch, max_steps=1)
    trainer.train()
    assert not (tmp_path / "out" / "completions").exists()
    assert "Advantage" not in capsys.readouterr().out
    log = _train_logs(trainer)[0]
    lengths = np.array([[len(ids) for ids in g.token_ids] for g in shaped.steps[0]["gens"]])
    assert log["completions/max_length"] == lengths.max()


# ---------------------------------------------------------------------------------------------- trackers
def test_trackio_and_tensorboard_get_scalars_and_completions(tmp_path, tiny_lm, tokenizer, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from trackio.sqlite_storage import SQLiteStorage

    project = f"dart-es-test-{tmp_path.name}"
    trainer, shaped = _trainer(
        tmp_path,
        tokenizer,
        tiny_lm,
        monkeypatch,
        log_completions=True,
        report_to=["trackio", "tensorboard"],
        project=project,
        run_name="run",
        num_completions_to_print=0,
    )
    trainer.train()
    logs = _train_logs(trainer)

    # trackio's local store: the scalars under Trainer's train/ prefix, and one completions table per step.
    stored = SQLiteStorage.get_logs(project, "run")
    scalars = [row for row in stored if "train/reward" in row]
    assert [row["train/reward"] for row in scalars] == pytest.approx([log["reward"] for log in logs])
    for key in ("frac_reward_zero_std", "completions/clipped_ratio", "num_tokens", "step_time"):
        assert [row[f"train/{key}"] for row in scalars] == pytest.approx([log[key] for log in logs]), key
    tables = [row["completions"] for row in stored if "completions" in row]
    assert len(tables) == 2
    for table, rec in zip(tables, shaped.steps, strict=True):
        assert table["_type"] == "trackio.table"
        rows = table["_value"]
        gens = rec["gens"]
        assert len(rows) == len(gens) * len(gens[0].texts)
        assert [r["completion"][0]["content"] for r in rows] == [t for g in gens for t in g.texts]
        # Seeds travel as text: a dashboard's JavaScript would round a 63-bit integer.
        assert [r["member_seed"] for r in rows] == [
            str(m.seed) for m in rec["members"] for _ in gens[0].texts
        ]
        np.testing.assert_allclose(
            [r["advantage"] for r in rows], np.repeat(rec["result"].z, len(gens[0].texts))
        )

    # TensorBoard's event files, through TensorBoard's own reader.
    (event_dir,) = {
        os.path.dirname(p)
        for p in glob.glob(str(tmp_path / "out" / "runs" / "**" / "events.out.tfevents.*"), recursive=True)
    }
    acc = EventAccumulator(event_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    for key in ("reward", "frac_reward_zero_std", "completions/max_length", "num_tokens"):
        events = acc.Scalars(f"train/{key}")
        assert [e.step for e in events] == [1, 2], key
        assert [e.value for e in events] == pytest.approx([log[key] for log in logs], rel=1e-6), key
    texts = acc.Tensors("completions/text_summary")
    assert [t.step for t in texts] == [1, 2]
    for event, rec in zip(texts, shaped.steps, strict=True):
        markdown = event.tensor_proto.string_val[0].decode()
        assert markdown.count("\n") == 1 + sum(len(g.texts) for g in rec["gens"])  # header, rule, one per row
        first = rec["gens"][0].texts[1].replace("|", "\\|").replace("\n", "<br>")
        assert f"| {first} |" in markdown


def _wandb_history(path: str) -> list[dict]:
    """The `history` rows of an offline wandb run file: a LevelDB-style log (32 KiB blocks, 7-byte record headers)
    of `Record` protobufs after a 7-byte `:W&B` header. wandb ships no Python reader for it."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, buf, rows = Path(path).read_bytes(), 7, b"", []
    block = 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            if record.HasField("history"):
                rows.append(
                    {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
                )
    return rows


def test_wandb_offline_gets_scalars_and_the_completions_table(tmp_path, tiny_lm, tokenizer, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    trainer, shaped = _trainer(
        tmp_path,
        tokenizer,
        tiny_lm,
        monkeypatch,
        log_completions=True,
        report_to="wandb",
        num_completions_to_print=0,
    )
    trainer.train()
    # finish() only asks the service to close the run; the service flushes the run file when it closes the
    # stream, asynchronously. teardown() waits for the service to exit, as a script's exit does.
    wandb.finish()
    wandb.teardown()
    (run_dir,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    (run_file,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    history = [row for row in _wandb_history(run_file) if "train/reward" in row]
    logs = _train_logs(trainer)
    for key in ("reward", "frac_reward_zero_std", "completions/clipped_ratio", "num_tokens"):
        assert [float(row[f"train/{key}"]) for row in history] == pytest.approx([log[key] for log in logs]), (
            key
        )
    tables = sorted(
        glob.glob(os.path.join(run_dir, "files", "media", "table", "completions_*.table.json")),
        key=lambda p: int(os.path.basename(p).split("_")[1]),
    )
    assert len(tables) == 2
    for path, rec in zip(tables, shaped.steps, strict=True):
        data = json.loads(Path(path).read_text())
        columns = data["columns"]
        assert columns[:3] == ["step", "member", "member_seed"] and "advantage" in columns
        completion, seed = columns.index("completion"), columns.index("member_seed")
        gens = rec["gens"]
        assert len(data["data"]) == len(gens) * len(gens[0].texts)
        assert [row[completion] for row in data["data"]] == [
            [{"role": "assistant", "content": t}] for g in gens for t in g.texts
        ]
        assert [row[seed] for row in data["data"]] == [
            str(m.seed) for m in rec["members"] for _ in gens[0].texts
        ]


# ------------------------------------------------------------------------------------- two processes
def test_two_processes_write_one_table_with_every_members_rows(tmp_path, embedded_tokenizer_dir):
    """The main process alone writes the parquet files, with the rows of members generated on either process."""
    from test_distributed import _run

    tables, logs = {}, {}
    for processes in (1, 2):
        out = tmp_path / f"p{processes}"
        rc, log, _ = _run(embedded_tokenizer_dir, out, processes, "--steps", "2", "--log-completions")
        assert rc == 0, log[-3000:]
        files = sorted((out / "trainer" / "completions").glob("completions_*.parquet"))
        assert [f.name for f in files] == ["completions_00001.parquet", "completions_00002.parquet"]
        tables[processes] = [pd.read_parquet(f) for f in files]
        logs[processes] = [e for e in json.loads((out / "rank0.json").read_text())["logs"] if "reward" in e]
    for one, two in zip(tables[1], tables[2], strict=True):
        assert sorted(set(two["member"])) == [0, 1, 2, 3]  # members 0, 2 from rank 0 and 1, 3 from rank 1
        for column in ("member", "member_seed", "problem_id", "parity_reward", "length_reward", "advantage"):
            assert two[column].tolist() == one[column].tolist(), column
        assert [c[0]["content"] for c in two["completion"]] == [c[0]["content"] for c in one["completion"]]
    for one, two in zip(logs[1], logs[2], strict=True):
        for key in (
            "completions/mean_length",
            "completions/clipped_ratio",
            "frac_reward_zero_std",
            "num_tokens",
        ):
            assert two[key] == one[key], key
