"""The README's quickstart is the demo: the `DartESConfig` it shows has quickstart.yaml's values."""

import ast
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _quickstart_call() -> ast.Call:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    tree = ast.parse(next(b for b in blocks if "DartESConfig(" in b))
    return next(
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "DartESConfig"
    )


def test_the_readme_quickstart_shows_the_demo_settings():
    demo = yaml.safe_load((ROOT / "recipes" / "configs" / "quickstart.yaml").read_text())
    shown = {
        kw.arg: ast.literal_eval(kw.value) for kw in _quickstart_call().keywords if kw.arg != "output_dir"
    }
    assert {k: demo[k] for k in shown} == shown
    # What changes the trajectory is all there: the run's shape, its noise and step, its backend and precision.
    assert {"population_size", "per_device_train_batch_size", "sigma", "learning_rate", "max_steps"} <= set(
        shown
    )
    assert {"perturbation", "use_vllm", "generation_dtype", "antithetic"} <= set(shown)
    readme = (ROOT / "README.md").read_text()
    assert f"version={demo['task_version']}" in readme and f'prompt_style="{demo["prompt_style"]}"' in readme
