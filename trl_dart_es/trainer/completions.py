"""What an ES step generated, reported the way TRL's `GRPOTrainer` reports it.

GRPO logs completion lengths (`completions/*`), `frac_reward_zero_std`, `num_tokens` and, with
`log_completions=True`, a table of prompts and completions: a rich sample on the console, one parquet file per
logging step in `output_dir/completions/`, and a `completions` table sent to wandb and trackio. This module does the
same for an ES step, where GRPO's group (one prompt, several completions) is one problem answered by every member
of the population. The table's rows are (member, problem) pairs, with the member's index and noise seed, and the
member's shaped fitness in GRPO's `advantage` column: the coefficient that member gets in the update, as an
advantage is a completion's coefficient in GRPO's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..distributed import gather_object_with_timeout
from ..rollout.prompts import as_completions, render_prompts

if TYPE_CHECKING:
    from ..noise import Member
    from ..replay import PlannedBatch
    from ..rollout.base import Generation
    from ..strategy import TellResult

COMPLETIONS_DIR = "completions"


@dataclass
class StepCompletions:
    """Every member's completions of one ES step, gathered from all processes; row n is member n."""

    lengths: np.ndarray  # N×B completion lengths in tokens (EOS included)
    clipped: np.ndarray  # N×B: hit `max_completion_length` before an EOS
    texts: list[list[str]] | None  # N lists of B texts; only with `log_completions`

    def metrics(self) -> dict[str, float]:
        """TRL's `completions/*` metrics over all N×B completions of the step."""
        lengths = self.lengths.astype(np.float64).ravel()
        clipped = self.clipped.astype(bool).ravel()
        terminated = lengths[~clipped]
        if terminated.size == 0:  # every completion clipped: GRPO logs 0, not NaN
            terminated = np.zeros(1)
        return {
            "completions/mean_length": float(lengths.mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(clipped.mean()),
            "completions/mean_terminated_length": float(terminated.mean()),
            "completions/min_terminated_length": float(terminated.min()),
            "completions/max_terminated_length": float(terminated.max()),
        }


def frac_reward_zero_std(total: np.ndarray) -> float:
    """Fraction of the step's problems on which every member got the same total reward.

    `total` is N×B (member × problem). GRPO's `frac_reward_zero_std` is the fraction of prompts whose completions all
    scored the same; here the "completions of a prompt" are the members' answers to one problem. Such a problem,
    solved by every member or by none, cannot tell members apart and adds nothing to the fitness differences.
    """
    if total.size == 0:
        return float("nan")
    return float(np.isclose(np.nanstd(total, axis=0), 0.0).mean())  # NaN: a member that did not score it


def gather_step_completions(
    local: Sequence[int],
    gens: Sequence[Generation],
    num_members: int,
    *,
    max_completion_length: int,
    eos_token_ids: Sequence[int],
    with_texts: bool,
    timeout: float,
    step: int,
) -> StepCompletions:
    """Lengths (and texts, with `with_texts`) of every member's completions, on every process.

    `local[i]` is the member index of `gens[i]`. With one process nothing is sent; with several, one gather of the
    lengths (and texts) per step, since only rewards cross processes in the ES step itself.
    """
    eos = set(eos_token_ids)
    rows = [
        (
            n,
            [len(ids) for ids in g.token_ids],
            # clipped as `Generation.num_clipped` counts them: at the limit and not ended by an EOS
            [len(ids) >= max_completion_length and (not ids or ids[-1] not in eos) for ids in g.token_ids],
            list(g.texts) if with_texts else None,
        )
        for n, g in zip(local, gens, strict=True)
    ]
    parts = gather_object_with_timeout(
        rows, timeout=timeout, what=f"DART-ES step {step} (completions gather)"
    )
    by_member = {n: (lengths, clipped, texts) for part in parts for n, lengths, clipped, texts in part}
    if sorted(by_member) != list(range(num_members)):
        raise RuntimeError(
            f"DART-ES step {step}: gathered completions of members {sorted(by_member)}, expected 0..{num_members - 1}"
        )
    ordered = [by_member[n] for n in range(num_members)]
    return StepCompletions(
        lengths=np.asarray([r[0] for r in ordered], dtype=np.int64),
        clipped=np.asarray([r[1] for r in ordered], dtype=bool),
        texts=[r[2] for r in ordered] if with_texts else None,
    )


def count_prompt_tokens(
    prompts: Sequence[Any], tokenizer, chat_template_kwargs: dict | None = None
) -> list[int]:
    """Tokens of each rendered prompt, as the generation backends tokenize them (no special tokens added)."""
    texts = render_prompts(prompts, tokenizer, chat_template_kwargs)
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def completions_table(
    step: int,
    batch: PlannedBatch,
    prompts: Sequence[Any],
    members: Sequence[Member],
    completions: StepCompletions,
    rewards: np.ndarray,
    reward_names: Sequence[str],
    result: TellResult,
    member_columns: Sequence[Sequence[int]] | None = None,
) -> dict[str, list[Any]]:
    """GRPO's completions table for one ES step, one row per (member, problem), member-major.

    Columns: `step`, `member`, `member_seed`, `prompt`, `completion`, one per reward function, `advantage` (the
    member's shaped fitness z_n; 0 on a skipped step, as GRPO zeroes a NaN advantage), then the ES columns
    `member_sign` (antithetic pairs share a seed), `fitness` (raw F_n), `problem_id`, `replayed` and
    `difficulty_weight` (w_j). In a grouped layout member n has rows for its problems `member_columns[n]` only.
    """
    if completions.texts is None:
        raise ValueError("completions_table needs the completions' texts (gathered with with_texts=True)")
    n_members, b = completions.lengths.shape
    cols = [list(range(b))] * n_members if member_columns is None else [list(c) for c in member_columns]
    z = np.zeros(n_members) if result.z is None else np.asarray(result.z, dtype=np.float64)
    # (member, problem column, index of the completion within the member's own)
    rows = [(n, j, i) for n in range(n_members) for i, j in enumerate(cols[n])]
    completion_cells = [
        as_completions([prompts[j] for j in cols[n]], texts) for n, texts in enumerate(completions.texts)
    ]
    table: dict[str, list[Any]] = {
        "step": [step] * len(rows),
        "member": [n for n, _, _ in rows],
        "member_seed": [int(members[n].seed) for n, _, _ in rows],
        "prompt": [prompts[j] for _, j, _ in rows],
        "completion": [completion_cells[n][i] for n, _, i in rows],
    }
    for k, name in enumerate(reward_names):
        table[name] = [float(rewards[k, n, j]) for n, j, _ in rows]
    table["advantage"] = [float(z[n]) for n, _, _ in rows]
    table["member_sign"] = [int(members[n].sign) for n, _, _ in rows]
    table["fitness"] = [float(result.fitness[n]) for n, _, _ in rows]
    table["problem_id"] = [batch.ids[j] for _, j, _ in rows]
    table["replayed"] = [bool(batch.replayed[j]) for _, j, _ in rows]
    table["difficulty_weight"] = [float(result.weights[j]) for _, j, _ in rows]
    return table


def record_step_completions(
    trainer,
    batch: PlannedBatch,
    prompts: Sequence[Any],
    members: Sequence[Member],
    local: Sequence[int],
    gens: Sequence[Generation],
    rewards: np.ndarray,
    result: TellResult,
    member_columns: Sequence[Sequence[int]] | None = None,
) -> tuple[dict[str, float], dict[str, list[Any]] | None]:
    """The step's `completions/*` metrics and, with `log_completions` on the main process, its table.

    Also adds the step's prompt and completion tokens (each member reads its prompts: all of them, or
    `member_columns[n]` in a grouped layout) to `trainer.state.num_input_tokens_seen`, TRL's `num_tokens`.
    """
    args = trainer.args
    step = trainer.state.global_step + 1  # the step being run; Trainer increments global_step after it
    completions = gather_step_completions(
        local,
        gens,
        len(members),
        max_completion_length=args.max_completion_length,
        eos_token_ids=trainer.eos_token_ids,
        with_texts=bool(args.log_completions),
        timeout=args.ddp_timeout,
        step=step,
    )
    per_prompt = count_prompt_tokens(prompts, trainer.processing_class, args.chat_template_kwargs)
    read = (
        len(members) * sum(per_prompt)
        if member_columns is None
        else sum(per_prompt[j] for cols in member_columns for j in cols)
    )
    trainer.state.num_input_tokens_seen += read + int(completions.lengths.sum())
    table = None
    if args.log_completions and trainer.accelerator.is_main_process:
        table = completions_table(
            step,
            batch,
            prompts,
            members,
            completions,
            rewards,
            trainer.reward_func_names,
            result,
            member_columns,
        )
    return completions.metrics(), table


# ------------------------------------------------------------------------------------------------ reporting
def _message_text(entry: Any) -> str:
    """Plain text of a prompt or completion: a string, one message's content, or `role: content` lines."""
    if isinstance(entry, list):
        messages = [m for m in entry if isinstance(m, dict)]
        if len(messages) == 1:
            return str(messages[0].get("content", ""))
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in messages)
    return str(entry)


def completions_markdown(table: dict[str, list[Any]], reward_names: Sequence[str]) -> str:
    """The table as Markdown, for TensorBoard's text tab (which renders Markdown tables)."""

    def cell(value: Any) -> str:
        text = _message_text(value) if isinstance(value, (list, str)) else f"{value:.4g}"
        return text.replace("|", "\\|").replace("\n", "<br>")

    columns = ["step", "member", "member_seed", "prompt", "completion", *reward_names, "advantage"]
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for i in range(len(table["step"])):
        values = [
            str(table["step"][i]),
            str(table["member"][i]),
            str(table["member_seed"][i]),
            *(cell(table[c][i]) for c in columns[3:]),
        ]
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines)


def _tensorboard_writer(trainer):
    from transformers.integrations import TensorBoardCallback

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, TensorBoardCallback) and callback.tb_writer is not None:
            return callback.tb_writer
    return None


def log_completions(trainer, table: dict[str, list[Any]]) -> None:
    """Report one step's completions table as GRPO does, on the calling (main) process.

    A rich sample of `num_completions_to_print` rows on the console (at steps that are multiples of
    `completions_print_steps`, when set), `output_dir/completions/completions_<step>.parquet` with every row, and a
    `completions` table to wandb and trackio when they are in `report_to`. TensorBoard has no table type: it gets
    the rows as a Markdown text summary named `completions`.
    """
    import pandas as pd
    from transformers.utils import is_rich_available

    args = trainer.args
    step = trainer.state.global_step
    reward_names = list(trainer.reward_func_names)
    n_rows = len(table["step"])
    every = args.completions_print_steps
    if is_rich_available() and args.num_completions_to_print != 0 and (every is None or step % every == 0):
        from trl.trainer.utils import print_prompt_completions_sample

        # The sample is drawn here, from a generator of its own: TRL's helper would draw from Python's global
        # `random`, part of the RNG state that checkpoints save and a resumed run must find unchanged.
        k = n_rows if args.num_completions_to_print is None else min(args.num_completions_to_print, n_rows)
        rows = sorted(np.random.default_rng([args.seed, step]).choice(n_rows, size=k, replace=False).tolist())
        print_prompt_completions_sample(
            [table["prompt"][i] for i in rows],
            [table["completion"][i] for i in rows],
            {name: [table[name][i] for i in rows] for name in reward_names},
            [table["advantage"][i] for i in rows],
            step,
            # The member's seed (19 digits) stays in the files: on an 80-column console it squeezes the text.
            extra={"member": [table["member"][i] for i in rows]},
        )

    df = pd.DataFrame(table)
    folder = os.path.join(args.output_dir, COMPLETIONS_DIR)
    os.makedirs(folder, exist_ok=True)
    df.to_parquet(os.path.join(folder, f"completions_{step:05d}.parquet"))

    report_to = args.report_to or []
    if "wandb" in report_to or "trackio" in report_to:
        # Seeds as text for the dashboards: JavaScript numbers would round a 63-bit seed.
        shown = df.assign(member_seed=df["member_seed"].astype(str))
    if "wandb" in report_to:
        import wandb

        if wandb.run is not None:
            wandb.log({"completions": wandb.Table(dataframe=shown)})
    if "trackio" in report_to:
        import trackio

        trackio.log({"completions": trackio.Table(dataframe=shown)})
    if "tensorboard" in report_to and (writer := _tensorboard_writer(trainer)) is not None:
        writer.add_text("completions", completions_markdown(table, reward_names), step)
        writer.flush()
