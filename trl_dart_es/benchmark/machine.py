"""What a measurement ran on: the `machine` of every row and every curve."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from collections import Counter
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else what `platform` knows)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_description() -> str:
    """CPU model, cores, memory and OS (and the GPU when there is one): the `machine` of every row."""
    parts = [f"{cpu_model()}, {os.cpu_count()} cores"]
    with contextlib.suppress(Exception):
        import psutil

        parts.append(f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM")
    gpu = _gpu_name()
    if gpu:
        parts.append(gpu)
    parts.append(f"{platform.system()} {platform.release()}")
    return ", ".join(parts)


def _gpu_name() -> str | None:
    with contextlib.suppress(Exception):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        names = [n.strip() for n in out.stdout.splitlines() if n.strip()]
        if out.returncode == 0 and names:
            return f"{len(names)}x {names[0]}"
    return None


def utc_now() -> str:
    """The `date` of a row or a curve: minutes, UTC."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def machines_summary(runs: Iterable[Mapping[str, Any]]) -> str:
    """The CPUs that runs came from, with their counts: one report may span several machines of this kind."""
    counts = Counter(r["machine"].split(",")[0] for r in runs)
    return ", ".join(f"{cpu} ({n} run{'s' if n != 1 else ''})" for cpu, n in counts.most_common())
