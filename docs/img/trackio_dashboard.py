"""Screenshot the trackio dashboard of a run, offline: `trackio show` on 127.0.0.1, headless Chromium, one PNG.

    python docs/img/trackio_dashboard.py --trackio-dir outputs/quickstart/trackio --project dart-es-quickstart \\
        --out docs/img/trackio_dashboard.png

Needs Chromium (Debian: `apt-get install chromium`). The dashboard is served on 127.0.0.1 only and stopped
afterwards; nothing is fetched from outside.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def start_dashboard(trackio_dir: str, project: str, timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """Start `trackio show` in a session of its own; return it and the URL it printed once it answers."""
    trackio = Path(sys.executable).with_name("trackio")
    env = {**os.environ, "TRACKIO_DIR": os.path.abspath(trackio_dir), "HF_HUB_OFFLINE": "1"}
    env.pop("DISPLAY", None)  # no browser window
    proc = subprocess.Popen(
        [str(trackio), "show", "--project", project, "--host", "127.0.0.1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    url = None
    assert proc.stdout is not None
    while url is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise RuntimeError(f"trackio show exited with {proc.returncode}")
            continue
        print(line, end="")
        match = re.search(r"http://127\.0\.0\.1:\d+[^\s'\"\x1b]*", line)
        if match:
            url = match.group(0)
    if url is None:
        stop(proc)
        raise RuntimeError("trackio show printed no local URL")
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=5).read(1)
            return proc, url
        except OSError:
            time.sleep(1)
    stop(proc)
    raise RuntimeError(f"the dashboard at {url} did not answer")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def screenshot(url: str, out: str, width: int, height: int, wait_ms: int) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        raise RuntimeError("no Chromium found (Debian: apt-get install chromium)")
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--window-size={width},{height}",
            f"--virtual-time-budget={wait_ms}",
            f"--screenshot={os.path.abspath(out)}",
            url,
        ],
        check=True,
        timeout=180,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trackio-dir", required=True, help="the run's trackio store (TRACKIO_DIR)")
    p.add_argument("--project", required=True)
    p.add_argument("--out", default=str(Path(__file__).with_name("trackio_dashboard.png")))
    p.add_argument("--width", type=int, default=1400)
    p.add_argument("--height", type=int, default=1000)
    p.add_argument(
        "--wait-ms", type=int, default=20000, help="virtual time Chromium gives the page to render"
    )
    args = p.parse_args()
    proc, url = start_dashboard(args.trackio_dir, args.project)
    try:
        screenshot(url, args.out, args.width, args.height, args.wait_ms)
    finally:
        stop(proc)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
