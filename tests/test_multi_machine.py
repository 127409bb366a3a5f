"""Several machines, many processes, a dead peer: real multi-machine launches on one host, over loopback.

Two `accelerate launch` commands with `--num_machines 2`, `--machine_rank 0|1` and `--main_process_ip 127.0.0.1`
form a real two-machine job: a static torchrun rendezvous over an address, a local rank 0 on each machine, one
gloo process group across both. Each machine gets its own output folder, as machines without a shared
filesystem would, so the tests see which machine wrote what. The script is tests/scripts/dist_train.py.

Default suite: two machines on the transformers backend (straight run and resume), a machine SIGKILLed mid-step,
a peer lost at a save. Slow: eight processes on two machines, two machines on the vLLM low-rank backend.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import requires_vllm
from safetensors.torch import load_file
from test_distributed import REPO, SCRIPT, _assert_bitwise_equal, _free_port, _result, _run

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="these runs check the CPU (gloo) launch path"
)

# Log keys that measure time or speed: they differ between any two runs. Every other logged value must match.
_TIMING = ("time/", "step_time", "tokens_per_s", "_runtime", "_per_second", "total_flos")


class Machines:
    """`machines` concurrent `accelerate launch` commands, one per machine rank, each in its own session and
    with its own output folder `<root>/m<rank>`."""

    def __init__(self, tokenizer_dir: str, root: Path, *args: str, machines: int = 2, per_machine: int = 1):
        self.root = root
        port = str(_free_port())
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.procs, self.logs = [], []
        for machine in range(machines):
            out = self.out(machine)
            out.mkdir(parents=True, exist_ok=True)
            cmd = [
                sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                "--num_machines", str(machines), "--num_processes", str(machines * per_machine),
                "--machine_rank", str(machine), "--main_process_ip", "127.0.0.1", "--main_process_port", port,
                "--mixed_precision", "no", "--dynamo_backend", "no",
                str(SCRIPT), "--tokenizer", tokenizer_dir, "--out", str(out), *args,
            ]  # fmt: skip
            log = open(root / f"launch{machine}.log", "w")  # a file, not a pipe: nobody has to drain it
            self.logs.append(log)
            self.procs.append(
                subprocess.Popen(
                    cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )

    def out(self, machine: int) -> Path:
        return self.root / f"m{machine}"

    def log(self, machine: int) -> str:
        return (self.root / f"launch{machine}.log").read_text()

    def wait(self, timeout: float) -> list[int]:
        """Every launcher's exit code; kills every process group and fails the test after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(0.0, deadline - time.monotonic())) for p in self.procs]
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the launch did not end within {timeout} s:\n{self.tail()}")
        finally:
            for log in self.logs:
                log.close()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def tail(self, chars: int = 3000) -> str:
        return "\n".join(f"--- machine {m}:\n{self.log(m)[-chars:]}" for m in range(len(self.procs)))


def _launch(tokenizer_dir, root: Path, *args: str, timeout: float = 240, **kw) -> Machines:
    machines = Machines(tokenizer_dir, root, *args, **kw)
    codes = machines.wait(timeout)
    assert codes == [0] * len(codes), machines.tail()
    return machines


def _comparable(logs: list[dict]) -> list[dict]:
    return [{k: v for k, v in entry.items() if not any(t in k for t in _TIMING)} for entry in logs]


def _assert_same_run(info: dict, weights: dict, ref_info: dict, ref_weights: dict) -> None:
    """Weights bitwise, the DART state exactly, and every logged value but timings exactly (Trainer's `loss`
    and `train_loss` too: a mean over the processes of a value every process holds, exact in any world size)."""
    _assert_bitwise_equal(weights, ref_weights)
    assert info["dart_state"] == ref_info["dart_state"]
    mine, ref = _comparable(info["logs"]), _comparable(ref_info["logs"])
    assert len(mine) == len(ref), (mine, ref)
    assert mine == ref, (mine, ref)
    assert any(e.get("update_norm", 0) > 0 for e in ref), "no step updated: equal weights would prove nothing"


def _files(folder: Path) -> list[str]:
    return (
        sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        if folder.exists()
        else []
    )


STEPS = ("--steps", "4", "--save-steps", "2")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, embedded_tokenizer_dir):
    """The reference: the same 4 steps in one process (N = 5, checkpoints at steps 2 and 4)."""
    out = tmp_path_factory.mktemp("one")
    rc, log, _ = _run(embedded_tokenizer_dir, out, 1, "--population", "5", *STEPS)
    assert rc == 0, log[-3000:]
    info, weights = _result(out, 0)
    assert info["world_size"] == 1 and info["global_step"] == 4
    return info, weights, out


def test_two_machines_end_bitwise_where_one_process_ends_and_only_machine_0_writes(
    tmp_path, embedded_tokenizer_dir, one_process
):
    """Two machines (one process each) over loopback: both end bitwise where one process ends (weights, DART
    state, log); machine 0's main process wrote every checkpoint, log and completions table, machine 1 nothing;
    resuming the two-machine run from its step-2 checkpoint ends bitwise where the straight run ends."""
    ref_info, ref_weights, ref_out = one_process
    args = ("--population", "5", *STEPS, "--log-completions", "--report-to", "tensorboard")
    run = _launch(embedded_tokenizer_dir, tmp_path / "straight", *args)
    for machine in (0, 1):
        info, weights = _result(run.out(machine), machine)
        assert info["world_size"] == info["torch_world_size"] == 2, "the launch did not start two processes"
        # One process per machine: each is the local main process of its machine, only rank 0 the global main.
        assert (info["rank"], info["machine_rank"], info["local_rank"]) == (machine, machine, 0)
        assert info["is_local_main_process"] and info["is_main_process"] == (machine == 0)
        assert info["local_members"] == ([0, 2, 4] if machine == 0 else [1, 3])  # N = 5: split 3 + 2
        _assert_same_run(info, weights, ref_info, ref_weights)

    written = _files(run.out(0) / "trainer")
    for step in (2, 4):
        for name in ("model.safetensors", "dart_es_state.json", "trainer_state.json", "rng_state_0.pth"):
            assert f"checkpoint-{step}/{name}" in written, written
        assert f"checkpoint-{step}/rng_state_1.pth" in written, (
            "rank 1's RNG state belongs in the checkpoint too"
        )
        assert f"completions/completions_{step:05d}.parquet" in written, written
    tensorboard = [name for name in written if name.startswith("runs/") and "tfevents" in name]
    assert tensorboard, written
    assert _files(run.out(1) / "trainer") == [], "machine 1 wrote into its output folder"
    # The checkpoint is the one-process run's at the same step: the weights bitwise, the DART state exactly.
    checkpoint = run.out(0) / "trainer" / "checkpoint-2"
    ref_checkpoint = ref_out / "trainer" / "checkpoint-2"
    _assert_bitwise_equal(
        load_file(str(checkpoint / "model.safetensors")), load_file(str(ref_checkpoint / "model.safetensors"))
    )
    state = json.loads((checkpoint / "dart_es_state.json").read_text())
    assert state["step"] == 2 and state == json.loads((ref_checkpoint / "dart_es_state.json").read_text())

    resumed = _launch(
        embedded_tokenizer_dir, tmp_path / "resumed", *args, "--resume", str(checkpoint)
    )  # both machines read machine 0's checkpoint (shared storage, or a copy on every machine)
    for machine in (0, 1):
        info, weights = _result(resumed.out(machine), machine)
        assert info["global_step"] == 4
        _assert_bitwise_equal(weights, ref_weights)
        assert info["dart_state"] == ref_info["dart_state"]
        # The resumed run logs steps 3 and 4 only: they match the straight run's.
        assert _comparable(info["logs"])[:2] == _comparable(ref_info["logs"])[2:4]
    assert _files(resumed.out(1) / "trainer") == []


def test_killed_peer_stops_every_other_process_and_its_checkpoint_resumes(
    tmp_path, embedded_tokenizer_dir, one_process
):
    """SIGKILL rank 1 (machine 1) in the middle of step 3: machine 0 exits non-zero within the timeout (+30 s) with
    an error naming rank 1, nothing hangs, the step-2 checkpoint is intact, and resuming it on two machines ends
    bitwise where the straight run ends."""
    ref_info, ref_weights, ref_out = one_process
    timeout_s = 20
    args = ("--population", "5", *STEPS, "--ddp-timeout", str(timeout_s))
    run = Machines(
        embedded_tokenizer_dir, tmp_path / "killed", *args, "--fail-rank", "1", "--fail-step", "3",
        "--fail-mode", "kill",
    )  # fmt: skip
    pid_file = run.out(1) / "kill_rank1.pid"
    deadline = time.monotonic() + 180
    while not pid_file.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in run.procs):
            run.kill()
            pytest.fail(f"rank 1 never reached step 3:\n{run.tail()}")
        time.sleep(0.2)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        run.procs[0].wait(timeout=timeout_s + 60)  # generous: the assertion below checks the bound
    except subprocess.TimeoutExpired:
        run.kill()
        pytest.fail(f"machine 0 still runs {timeout_s + 60} s after its peer was killed:\n{run.tail()}")
    seconds = time.monotonic() - killed_at
    codes = run.wait(timeout=60)  # machine 1's launcher must end too: its only worker is gone
    log = run.log(0)
    print(f"kill-to-exit of machine 0: {seconds:.1f} s (ddp_timeout {timeout_s} s)")
    assert codes[0] != 0 and codes[1] != 0, run.tail()
    assert seconds < timeout_s + 30, f"machine 0 took {seconds:.0f} s to stop"
    assert "GatherError: DART-ES step 3 (reward gather)" in log, run.tail()
    assert "rank 1 never reached it" in log, run.tail()
    assert not (run.out(0) / "rank0.json").exists()  # the survivor did not finish as if nothing happened
    for proc in run.procs:  # nothing left running: no process remains in either launch's process group
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)

    checkpoints = sorted(p.name for p in (run.out(0) / "trainer").glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-2"], checkpoints
    checkpoint = run.out(0) / "trainer" / "checkpoint-2"
    assert json.loads((checkpoint / "dart_es_state.json").read_text())["step"] == 2
    assert load_file(str(checkpoint / "model.safetensors")).keys()  # readable, not torn

    resumed = _launch(embedded_tokenizer_dir, tmp_path / "resumed", *args, "--resume", str(checkpoint))
    for machine in (0, 1):
        info, weights = _result(resumed.out(machine), machine)
        assert info["global_step"] == 4
        _assert_bitwise_equal(weights, ref_weights)
        assert info["dart_state"] == ref_info["dart_state"]


def test_peer_lost_at_a_save_leaves_no_partial_checkpoint(tmp_path, embedded_tokenizer_dir):
    """Rank 1 dies as the checkpoint of step 4 begins: rank 0 stops with an error naming it before it writes any
    file of checkpoint-4 (the save's one collective comes first), so the last checkpoint on disk is complete."""
    rc, log, elapsed = _run(
        embedded_tokenizer_dir, tmp_path / "run", 2, "--population", "5", *STEPS, "--ddp-timeout", "20",
        "--fail-rank", "1", "--fail-step", "4", "--fail-mode", "save-exit", timeout=120,
    )  # fmt: skip
    assert "[rank 1] failing (save-exit) at the save of step 4" in log, log[-3000:]
    assert rc != 0, log[-3000:]
    assert "GatherError: DART-ES checkpoint-4 (RNG states)" in log and "rank 1 never reached it" in log, log[
        -3000:
    ]
    trainer_dir = tmp_path / "run" / "trainer"
    assert sorted(p.name for p in trainer_dir.glob("checkpoint-*")) == ["checkpoint-2"]
    assert {"model.safetensors", "dart_es_state.json", "trainer_state.json", "rng_state_1.pth"} <= {
        p.name for p in (trainer_dir / "checkpoint-2").iterdir()
    }


# ------------------------------------------------------------------------------------------ slow variants
@pytest.mark.slow
def test_eight_processes_on_two_machines_end_bitwise_where_one_ends(tmp_path, embedded_tokenizer_dir):
    """Two machines of four processes each (local ranks 0-3 on each), N = 11 split 2,2,2,1,1,1,1,1."""
    args = ("--population", "11", "--steps", "3")
    rc, log, _ = _run(embedded_tokenizer_dir, tmp_path / "one", 1, *args)
    assert rc == 0, log[-3000:]
    ref_info, ref_weights = _result(tmp_path / "one", 0)
    run = _launch(embedded_tokenizer_dir, tmp_path / "eight", *args, per_machine=4, timeout=500)
    members = []
    for rank in range(8):
        machine = rank // 4
        info, weights = _result(run.out(machine), rank)
        assert info["world_size"] == info["torch_world_size"] == 8
        assert (info["machine_rank"], info["local_rank"]) == (machine, rank % 4)
        assert info["is_main_process"] == (rank == 0) and info["is_local_main_process"] == (rank % 4 == 0)
        members.append(info["local_members"])
        _assert_same_run(info, weights, ref_info, ref_weights)
    assert members == [list(range(r, 11, 8)) for r in range(8)]


@requires_vllm
@pytest.mark.slow
def test_two_machines_on_vllm_lowrank_end_bitwise_where_one_process_ends(tmp_path, embedded_tokenizer_dir):
    """The vLLM low-rank backend: one engine per process, on each machine; straight and resumed runs."""
    args = ("--population", "4", "--steps", "3", "--save-steps", "2", "--vllm-lowrank")
    rc, log, _ = _run(embedded_tokenizer_dir, tmp_path / "one", 1, *args, timeout=400)
    assert rc == 0, log[-3000:]
    ref_info, ref_weights = _result(tmp_path / "one", 0)
    assert ref_info["rollout"] == "VLLMLowRankRollout"
    run = _launch(embedded_tokenizer_dir, tmp_path / "two", *args, timeout=500)
    for machine in (0, 1):
        info, weights = _result(run.out(machine), machine)
        assert info["world_size"] == 2 and info["rollout"] == "VLLMLowRankRollout"
        assert info["local_members"] == [machine, machine + 2]
        _assert_same_run(info, weights, ref_info, ref_weights)
    assert _files(run.out(1) / "trainer") == []
    checkpoint = run.out(0) / "trainer" / "checkpoint-2"
    resumed = _launch(
        embedded_tokenizer_dir, tmp_path / "resumed", *args, "--resume", str(checkpoint), timeout=500
    )
    for machine in (0, 1):
        info, weights = _result(resumed.out(machine), machine)
        assert info["global_step"] == 3
        _assert_bitwise_equal(weights, ref_weights)
        assert info["dart_state"] == ref_info["dart_state"]
