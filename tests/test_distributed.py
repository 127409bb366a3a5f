"""The population split over processes: two CPU processes under `accelerate launch` end bitwise where one
process ends, and a dead or stuck process ends the run with a clear error instead of a hang.

The runs use tests/scripts/dist_train.py on a tiny model; every process records its world size, so a run
that silently started one process cannot pass as two.
"""

import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
from accelerate.utils import DistributedType
from conftest import run_launch
from safetensors.torch import load_file

from trl_dart_es import DartESConfig
from trl_dart_es.distributed import check_distributed_setup, check_not_sharded, gather_object_with_timeout

SCRIPT = Path(__file__).parent / "scripts" / "dist_train.py"
REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="these runs check the CPU (gloo) launch path"
)


def _free_port() -> int:
    # Not 29500: other jobs on the machine may launch at the same time.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(
    tokenizer_dir, out: Path, processes: int, *args: str, timeout: float = 180
) -> tuple[int, str, float]:
    script = [str(SCRIPT), "--tokenizer", tokenizer_dir, "--out", str(out), *args]
    if processes == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [
            sys.executable, "-m", "accelerate.commands.launch",
            "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
            *script,
        ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.monotonic()
    returncode, log = run_launch(cmd, env, timeout, cwd=REPO)
    return returncode, log, time.monotonic() - start


def _result(out: Path, rank: int):
    info = json.loads((out / f"rank{rank}.json").read_text())
    return info, load_file(str(out / f"rank{rank}.safetensors"))


def _assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].view(torch.int32), b[name].view(torch.int32)), f"{name} differs"


@pytest.mark.parametrize("population, group", [(4, None), (5, None), (4, 2)])
def test_two_processes_end_bitwise_where_one_process_ends(
    tmp_path, embedded_tokenizer_dir, population, group
):
    """Also in the grouped layout (population 4 in groups of 2): each process's members score other blocks."""
    args = ("--population", str(population), "--steps", "3")
    if group:
        args += ("--members-per-group", str(group))
    rc, log, _ = _run(embedded_tokenizer_dir, tmp_path / "one", 1, *args)
    assert rc == 0, log[-3000:]
    rc, log, _ = _run(embedded_tokenizer_dir, tmp_path / "two", 2, *args)
    assert rc == 0, log[-3000:]

    ref_info, ref_weights = _result(tmp_path / "one", 0)
    assert ref_info["world_size"] == 1 and ref_info["global_step"] == 3
    assert ref_info["local_members"] == list(range(population))
    members = []
    for rank in (0, 1):
        info, weights = _result(tmp_path / "two", rank)
        assert info["world_size"] == info["torch_world_size"] == 2, "the launch did not start two processes"
        assert info["rank"] == rank and info["global_step"] == 3
        members.append(info["local_members"])
        _assert_bitwise_equal(weights, ref_weights)
        assert info["dart_state"] == ref_info["dart_state"]
        # Same rewards on every step (timings aside): the gathered matrix is the one-process matrix.
        for mine, ref in zip(info["logs"], ref_info["logs"], strict=True):
            for key in ("reward", "reward_std", "fitness/std", "update_norm", "dart/buffer_size"):
                if key in ref:
                    assert mine[key] == ref[key], (key, mine[key], ref[key])
    assert members == [list(range(0, population, 2)), list(range(1, population, 2))]
    # The steps did update (no step skipped for lack of signal), so equal weights are not equal by default.
    assert all(log["update_norm"] > 0 for log in ref_info["logs"] if "update_norm" in log)


@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_dead_or_stuck_process_ends_the_run_with_a_clear_error(tmp_path, embedded_tokenizer_dir, mode):
    """Rank 1 dies silently (`os._exit(0)`) or hangs in its reward function at step 2: rank 0 must stop within
    `ddp_timeout`, naming the step and the missing rank, and the launch must fail."""
    timeout_s = 8
    rc, log, elapsed = _run(
        embedded_tokenizer_dir, tmp_path / "run", 2,
        "--steps", "3", "--fail-rank", "1", "--fail-step", "2", "--fail-mode", mode, "--ddp-timeout", str(timeout_s),
        timeout=120,
    )  # fmt: skip
    assert "[rank 1] failing" in log, log[-3000:]
    assert rc != 0, log[-3000:]
    assert "GatherError: DART-ES step 2 (reward gather)" in log, log[-3000:]
    assert "rank 1 never reached it" in log, log[-3000:]
    assert elapsed < 60, f"took {elapsed:.0f} s"
    assert not (tmp_path / "run" / "rank0.json").exists()


def test_cpu_launch_without_use_cpu_is_refused(tmp_path, embedded_tokenizer_dir):
    """Without use_cpu, Accelerate on a GPU-less machine gives each of the two processes a world of one: each
    would run the whole population alone. The trainer must refuse instead."""
    rc, log, _ = _run(embedded_tokenizer_dir, tmp_path / "run", 2, "--no-use-cpu", timeout=120)
    assert rc != 0
    assert "torch.distributed runs 2 processes but Accelerate sees 1" in log, log[-3000:]
    assert "use_cpu=True" in log


# ------------------------------------------------------------------------------------- in one process
def test_gather_in_one_process_returns_the_object():
    assert gather_object_with_timeout({"a": 1}, timeout=1.0) == [{"a": 1}]


def test_fsdp_launch_is_refused_with_what_to_use_instead(tmp_path, monkeypatch):
    # What `accelerate launch` with an FSDP config sets for the script.
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(
        ValueError, match="does not run under FSDP"
    ) as err:  # at construction, the clearest place
        DartESConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert "multi_gpu.yaml" in str(err.value)


class _Args:
    """The fields `check_not_sharded` reads. Real DeepSpeed arguments need the optional deepspeed package."""

    def __init__(self, deepspeed=None, fsdp=None, distributed_type=DistributedType.NO):
        self.deepspeed, self.fsdp, self.device = deepspeed, fsdp, "cpu"
        self.distributed_state = type(
            "State", (), {"distributed_type": distributed_type, "num_processes": 1}
        )()


@pytest.mark.parametrize(
    "args,env,name",
    [
        (_Args(deepspeed="ds_config.json"), {}, "DeepSpeed"),  # TrainingArguments(deepspeed=...)
        (
            _Args(),
            {"ACCELERATE_USE_DEEPSPEED": "true"},
            "DeepSpeed",
        ),  # accelerate launch + deepspeed_zero3.yaml
        (_Args(distributed_type=DistributedType.DEEPSPEED), {}, "DeepSpeed"),
        (_Args(distributed_type=DistributedType.FSDP), {}, "FSDP"),
        (_Args(fsdp=["full_shard"]), {}, "FSDP"),
    ],
)
def test_sharded_setups_are_refused(monkeypatch, args, env, name):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=f"does not run under {name}"):
        check_not_sharded(args)


def test_plain_setup_is_accepted(tmp_path):
    check_distributed_setup(DartESConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none"))


def test_config_refuses_fsdp_fields_at_construction(tmp_path):
    with pytest.raises(ValueError, match="does not run under FSDP"):
        DartESConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", fsdp="full_shard")


def test_trainer_refuses_fsdp_before_loading_the_model(tmp_path, monkeypatch):
    from trl_dart_es import DartESTrainer

    args = DartESConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # set after the config: the trainer checks again
    with pytest.raises(ValueError, match="does not run under FSDP"):  # not an error about the missing model
        DartESTrainer(
            "no/such-model", reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args
        )
