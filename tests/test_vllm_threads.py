"""Torch threads once a vLLM engine has started on CPU (`DartESConfig.vllm_cpu_threads`).

The engine and the trainer share the process's torch threads. vLLM's CPU worker disables `torch.set_num_threads`
process-wide (and its request for 1 thread goes through the disabled function); `start_engine` restores the
function and applies `cpu_threads_for_engine`'s count: by default the process's share of the cores (measured:
docs/vllm.md, "Threads"). No vLLM needed: the policy is a pure
function, and `start_engine` runs against a stand-in `vllm` module that does what the CPU worker does.
"""

import logging
import sys
import types

import pytest
import torch
from conftest import make_tiny_llama, tiny_es_config

from trl_dart_es.rollout import vllm_engine
from trl_dart_es.rollout.vllm_engine import cpu_threads_for_engine, get_local_world_size

NO_ENV: dict[str, str] = {}


# ------------------------------------------------------------------------------------------------ policy
@pytest.mark.parametrize(
    "cores, processes, expected",
    [(2, 1, 2), (2, 2, 1), (8, 3, 2), (16, 4, 4), (2, 3, 1), (1, 1, 1)],
)
def test_default_is_the_process_share_of_the_cores(cores, processes, expected):
    assert cpu_threads_for_engine(None, local_world_size=processes, cores=cores, environ=NO_ENV) == expected


def test_a_requested_count_is_kept_within_the_share_and_capped_above_it(caplog):
    assert cpu_threads_for_engine(1, cores=2, environ=NO_ENV) == 1
    assert cpu_threads_for_engine(3, local_world_size=2, cores=8, environ=NO_ENV) == 3
    assert cpu_threads_for_engine(1, cores=16, environ=NO_ENV) == 1  # a request beats the default
    with caplog.at_level(logging.WARNING, logger=vllm_engine.__name__):
        assert cpu_threads_for_engine(4, local_world_size=2, cores=4, environ=NO_ENV) == 2
    assert "vllm_cpu_threads=4 is capped at 2" in caplog.text


def test_omp_num_threads_wins_over_the_default_and_a_requested_count(caplog):
    env = {"OMP_NUM_THREADS": "1"}
    assert cpu_threads_for_engine(None, cores=8, environ=env) is None  # None: leave torch as it is
    with caplog.at_level(logging.WARNING, logger=vllm_engine.__name__):
        assert cpu_threads_for_engine(2, cores=8, environ=env) is None
    assert "vllm_cpu_threads=2 is ignored: OMP_NUM_THREADS=1" in caplog.text
    # The value vLLM sets for its own worker processes is not a user's choice.
    env_by_vllm = {"OMP_NUM_THREADS": "1", "VLLM_OMP_NUM_THREADS_SET_BY_VLLM": "1"}
    assert cpu_threads_for_engine(None, cores=4, environ=env_by_vllm) == 4


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True])
def test_bad_requested_counts_are_refused_with_their_value(bad):
    with pytest.raises(ValueError, match=f"vllm_cpu_threads={bad!r} is invalid"):
        cpu_threads_for_engine(bad, environ=NO_ENV)


def test_local_world_size_comes_from_the_launcher_else_the_world_size():
    assert get_local_world_size(4, {"LOCAL_WORLD_SIZE": "2"}) == 2  # e.g. 2 nodes x 2 processes
    assert get_local_world_size(1, {"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}) == 3
    assert get_local_world_size(4, {"LOCAL_WORLD_SIZE": "x"}) == 4  # unreadable: every process here
    assert get_local_world_size(2, NO_ENV) == 2
    assert get_local_world_size(0, NO_ENV) == 1


def test_config_validates_vllm_cpu_threads(tmp_path):
    assert tiny_es_config(tmp_path).vllm_cpu_threads is None
    assert tiny_es_config(tmp_path, vllm_cpu_threads=2).vllm_cpu_threads == 2
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"DartESConfig.vllm_cpu_threads={bad} is invalid"):
            tiny_es_config(tmp_path, vllm_cpu_threads=bad)


# ------------------------------------------------------------------------ start_engine, stand-in vLLM
class _CpuWorkerLikeLLM:
    """Stands in for `vllm.LLM` on CPU as vLLM 0.32's worker behaves in-process: `torch.set_num_threads` is
    replaced by a no-op (init_device), then 1 thread is requested through it (load_model), which does nothing."""

    started = 0

    def __init__(self, **kwargs):
        import os

        type(self).started += 1
        torch.set_num_threads = lambda n: None
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)

        class Runner:
            def reload_weights(self, weights_iterator=None, is_checkpoint_format=True):
                pass

        self.worker = types.SimpleNamespace(model_runner=Runner())

    def collective_rpc(self, fn):
        return [fn(self.worker)]


@pytest.fixture
def cpu_vllm(monkeypatch):
    """A stand-in `vllm` on a CPU platform; torch's thread count and function are restored afterwards."""
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.__version__ = _CpuWorkerLikeLLM, "0.0-fake"
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: True)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    for key in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING"):  # start_engine sets them
        monkeypatch.setenv(key, "")
    for key in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    _CpuWorkerLikeLLM.started = 0
    threads = torch.get_num_threads()
    yield
    vllm_engine.shutdown_engine()
    torch.set_num_threads = vllm_engine._ORIGINAL_SET_NUM_THREADS
    torch.set_num_threads(threads)


@pytest.mark.parametrize("max_loras", [0, 2])  # the full-rank and the low-rank (LoRA) engine
def test_start_engine_on_cpu_applies_the_default_threads(cpu_vllm, max_loras):
    torch.set_num_threads(1)
    engine = vllm_engine.start_engine(make_tiny_llama(hidden=16, layers=1), max_loras=max_loras)
    assert engine.vllm_threads == 1  # what the process had once the worker started
    assert torch.set_num_threads is vllm_engine._ORIGINAL_SET_NUM_THREADS
    assert torch.get_num_threads() == cpu_threads_for_engine(None)  # this machine's cores


def test_start_engine_on_cpu_applies_a_requested_count(cpu_vllm):
    vllm_engine.start_engine(make_tiny_llama(hidden=16, layers=1), cpu_threads=1)
    assert torch.get_num_threads() == 1


def test_start_engine_leaves_threads_alone_under_omp_num_threads(cpu_vllm, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)  # what torch reads from OMP_NUM_THREADS at start-up
    engine = vllm_engine.start_engine(make_tiny_llama(hidden=16, layers=1), cpu_threads=2)
    assert engine.vllm_threads == 3 and torch.get_num_threads() == 3


def test_start_engine_refuses_a_bad_count_before_starting_anything(cpu_vllm):
    with pytest.raises(ValueError, match="vllm_cpu_threads=0 is invalid"):
        vllm_engine.start_engine(make_tiny_llama(hidden=16, layers=1), cpu_threads=0)
    assert _CpuWorkerLikeLLM.started == 0
