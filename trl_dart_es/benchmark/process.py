"""One child process per run: the parent starts it, samples its memory, shows its progress and stops it.

The parent writes a spec file and starts `python -m trl_dart_es.benchmark --child <spec>` (under `accelerate
launch` for a multi-process row); the child (`child.child_main`) trains, writes its result file and exits. The
side-by-side rows (`run`) and the curves (`curves`) both run their children through `spawn`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .machine import _gpu_name
from .methods import METHODS, BenchMethod, _missing
from .workload import LAUNCH_CONFIG_DIR, REPO_ROOT, Workload


def _tree_rss(pid: int) -> tuple[int, int]:
    """RSS in bytes of a process and all its descendants, and of the largest one ((0, 0) if it is gone)."""
    try:
        import psutil
    except ImportError:  # the child's own ru_maxrss still gives a peak
        return 0, 0
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0, 0
    sizes = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            sizes.append(p.memory_info().rss)
    return sum(sizes), max(sizes, default=0)


def tail(path: Path, lines: int = 25) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def last_line(text: str | None, default: str = "") -> str:
    lines = (text or "").strip().splitlines()
    return lines[-1] if lines else default


def failure(observed: dict) -> dict[str, str]:
    """`status` and `error` of a child that returned no result: its error, else its log's tail."""
    error = observed.get("error") or (tail(Path(observed["log"])) if observed.get("log") else "")
    return {"status": "timeout" if observed.get("timed_out") else "failed", "error": error}


def free_port() -> int:
    """A free TCP port for a launch's rendezvous: other jobs on the machine may launch at the same time."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(
    name: str,
    workload: Workload,
    work_dir: Path,
    bar=None,
    *,
    extra: dict[str, Any] | None = None,
    stem: str | None = None,
) -> tuple[dict | None, dict]:
    """Run one child to completion; return its result (None on failure) and what the parent observed.

    `extra` is added to the child's spec (e.g. a curve's mode, seed and budget); `stem` names its files in
    `work_dir` (default: `name`). A method whose `requires` are missing is not started.
    """
    method = METHODS.get(name)
    missing = _missing(method.requires) if method is not None else []
    if missing:
        return None, {"error": f"missing modules: {', '.join(missing)}", "wall_s": 0.0}
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    stem = stem or name
    spec_path, result_path = work_dir / f"{stem}.spec.json", work_dir / f"{stem}.result.json"
    progress_path, log_path = work_dir / f"{stem}.progress", work_dir / f"{stem}.log"
    for path in (result_path, progress_path):
        path.unlink(missing_ok=True)
    spec = {"method": name, "workload": asdict(workload), "result_path": str(result_path),
            "progress_path": str(progress_path), **(extra or {})}  # fmt: skip
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "trl_dart_es.benchmark", "--child", str(spec_path)]
    if method is not None and method.launch is not None:
        cmd, launch_env = launch_command(method, workload, cmd[1:])
        env.update(launch_env)
    started = time.monotonic()
    peak, peak_one, timed_out, shown = 0, 0, False, ""
    with open(log_path, "w") as log:
        # Its own session, so that a timeout can stop the child and its workers (and nothing else).
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            while proc.poll() is None:
                total, largest = _tree_rss(proc.pid)
                peak, peak_one = max(peak, total), max(peak_one, largest)
                if bar is not None:
                    with contextlib.suppress(OSError):
                        text = progress_path.read_text().strip()
                        if text != shown:  # redraw only on change: logs of the bar stay short
                            bar.set_postfix_str(text, refresh=True)
                            shown = text
                if time.monotonic() - started > workload.timeout_s:
                    timed_out = True
                    stop(proc)
                    break
                time.sleep(0.5)
        except BaseException:
            stop(proc)
            raise
    observed = {"rc": proc.returncode, "wall_s": time.monotonic() - started, "peak_tree_rss_mb": peak / 2**20,
                "peak_process_rss_mb": peak_one / 2**20, "log": str(log_path), "timed_out": timed_out}  # fmt: skip
    if proc.returncode == 0 and result_path.is_file():
        return json.loads(result_path.read_text()), observed
    return None, observed


def launch_command(method: BenchMethod, workload: Workload, child: list[str]) -> tuple[list[str], dict]:
    """`accelerate launch` of the child module with the method's Accelerate config (its CPU or its CUDA one)
    on `method.processes` processes, and the environment it needs (threads split over the processes, a
    persistent cache for DeepSpeed's compiled CPU op)."""
    cpu_config, cuda_config = method.launch
    on_cuda = workload.device == "cuda" or (workload.device == "auto" and _gpu_name() is not None)
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(LAUNCH_CONFIG_DIR / (cuda_config if on_cuda else cpu_config)),
        "--num_processes", str(method.processes), "--main_process_port", str(free_port()), *child,
    ]  # fmt: skip
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".cache" / "torch_extensions"))
    env = {"TORCH_EXTENSIONS_DIR": extensions}
    if not on_cuda:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // method.processes))
    return cmd, env


def stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)  # the group the child leads (start_new_session): only what we started
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)


def peak_memory(result: dict, observed: dict) -> dict[str, Any]:
    """A child's peak memory from what it reported (`result`) and what the parent sampled (`observed`).

    `peak_mem_mb`: on CPU the peak RSS of the whole process tree (the parent's samples, or the kernel's
    `ru_maxrss`, whichever is larger); on CUDA the sum over processes of `max_memory_reserved`.
    `peak_mem_mb_max_process`: the largest single process (what one device must hold): the kernel's peak of
    each training process or the parent's samples of the largest process, whichever is larger.
    """
    cuda = result.get("peak_cuda_reserved_mb")
    cpu_peak = max(observed.get("peak_tree_rss_mb", 0.0), result.get("peak_rss_self_mb", 0.0),
                   result.get("peak_rss_children_mb", 0.0))  # fmt: skip
    ranks = result.get("ranks") or [result]
    one_peak = max(
        [observed.get("peak_process_rss_mb", 0.0)] + [r.get("peak_rss_self_mb", 0.0) for r in ranks]
    )
    if cuda is not None:
        cuda_ranks = [r.get("peak_cuda_reserved_mb") or 0.0 for r in ranks]
        cuda, one_peak = sum(cuda_ranks), max(cuda_ranks)
    return {
        "peak_mem_mb": cuda if cuda is not None else cpu_peak,
        "peak_mem_mb_max_process": one_peak,
        "processes": result.get("processes", 1),
        "mem_kind": "cuda_max_memory_reserved" if cuda is not None else "cpu_peak_rss",
        "peak_rss_mb": cpu_peak,
    }
