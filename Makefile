# Two commands matter: `make demo` and `make test`. Both create .venv from requirements.lock
# on first use, so a fresh clone with Python 3.11 and pip needs nothing else.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The second environment: the real verl 0.9.1 next to the same torch / megatron-core.
VERL_VENV  ?= .venv-verl
VERL_BIN   := $(VERL_VENV)/bin
VERL_STAMP := $(VERL_VENV)/.installed
# Nemotron-H's reference: transformers 5.25 (verl pins < 5.11) next to the same torch.
NEMO_VENV  ?= .venv-nemotron
NEMO_BIN   := $(NEMO_VENV)/bin
NEMO_STAMP := $(NEMO_VENV)/.installed
# The fourth: MkDocs and the Material theme (requirements-docs.lock; no torch) for `make docs`.
DOCS_VENV  ?= .venv-docs
DOCS_BIN   := $(DOCS_VENV)/bin
DOCS_STAMP := $(DOCS_VENV)/.installed

.PHONY: demo test test-fast test-slow test-verl test-main-ppo-replay test-nemotron test-megatron-bridge test-compat compat-smoke compat-smoke-envs verl-env nemotron-env docs lint format bench bench-ssd bench-dsa clean-venv

$(STAMP): requirements.lock pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "make: $(PYTHON) not found; run with PYTHON=/path/to/python3.11" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -r requirements.lock
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	@touch $@

# `pip install -e .` (no deps) registers the package's entry points, verl.plugins included.
$(VERL_STAMP): requirements-verl.lock pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "make: $(PYTHON) not found; run with PYTHON=/path/to/python3.11" >&2; exit 1; }
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_BIN)/python -m pip install --quiet -r requirements-verl.lock
	$(VERL_BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	@touch $@

$(NEMO_STAMP): requirements-nemotron.lock pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "make: $(PYTHON) not found; run with PYTHON=/path/to/python3.11" >&2; exit 1; }
	$(PYTHON) -m venv $(NEMO_VENV)
	$(NEMO_BIN)/python -m pip install --quiet -r requirements-nemotron.lock
	$(NEMO_BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	@touch $@

$(DOCS_STAMP): requirements-docs.lock
	@command -v $(PYTHON) >/dev/null || { echo "make: $(PYTHON) not found; run with PYTHON=/path/to/python3.11" >&2; exit 1; }
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_BIN)/python -m pip install --quiet -r requirements-docs.lock
	@touch $@

demo: $(STAMP)
	$(BIN)/mcore-npu train --config configs/gpt_tiny.yaml

# tests/integrations need the verl environment, tests/nemotron and tests/dsa_hf the Nemotron-H
# one: `make test` leaves them out, `make test-verl` / `make test-nemotron` run only them. All
# run on TEST_WORKERS pytest-xdist workers (0: in one process); a test module stays on one
# worker, so its module fixtures are made once.
TEST_WORKERS ?= 2
PARALLEL     := -n $(TEST_WORKERS) --dist loadfile

# SLOW: rarely-changing checks kept out of `make test` (and CI) to hold CI under 30 minutes on
# 2 cores: the trainer's signal and crash handling, the quick benchmarks (`make test-slow`)
SLOW := tests/training/test_failures.py tests/tools/test_bench.py
test: $(STAMP)
	$(BIN)/python -m pytest -q $(PARALLEL) --ignore=tests/integrations --ignore=tests/nemotron --ignore=tests/vision_hf --ignore=tests/dsa_hf $(SLOW:%=--ignore=%)

# 40 tests, about 2 minutes on 2 cores (docs/contributing.md)
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q $(PARALLEL) $(SLOW)

# the inner loop: the operator, mask, CPU-runtime and spec unit tests, no torchrun and no
# trainer runs in a subprocess (docs/contributing.md: run it first; under 2 minutes on 2 cores)
FAST := tests/ops tests/masks tests/cpu tests/transformer tests/test_layering.py tests/test_text.py
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q $(PARALLEL) -m "not distributed and not slow" $(FAST)

test-verl: $(VERL_STAMP)
	$(VERL_BIN)/python -m pytest -q $(PARALLEL) tests/integrations tests/vision_hf \
		--ignore=tests/integrations/test_main_ppo_replay.py

# R3 router replay in verl's own trainer (docs/router_replay.md): three more main_ppo launches,
# about 330 s of CPU, kept out of CI's test-verl
test-main-ppo-replay: $(VERL_STAMP)
	$(VERL_BIN)/python -m pytest -q tests/integrations/test_main_ppo_replay.py

# Nemotron-H against transformers 5.25 (verl pins < 5.11): the environment of its own; Qwen3-VL
# (tests/vision_hf) against both 5.10.4 (test-verl) and 5.25; GLM-5 / DeepSeek-V3.2 (tests/dsa_hf)
test-nemotron: $(NEMO_STAMP)
	$(NEMO_BIN)/python -m pytest -q $(PARALLEL) tests/nemotron tests/vision_hf tests/dsa_hf

# opt-in, not CI: verl's Megatron-Bridge path (vanilla_mbridge=False) against a scratch
# megatron-bridge 0.3.1 (--no-deps, its TE/Triton-only modules replaced by stand-ins) in
# MEGATRON_BRIDGE_DIR, put on PYTHONPATH of the verl environment (docs/weight_path.md)
MEGATRON_BRIDGE_DIR ?= $(CURDIR)/.megatron-bridge
test-megatron-bridge: $(VERL_STAMP)
	$(VERL_BIN)/python -m scripts.megatron_bridge_env $(MEGATRON_BRIDGE_DIR)
	PYTHONPATH=$(MEGATRON_BRIDGE_DIR) $(VERL_BIN)/python -m pytest -q \
		tests/integrations/scratch_megatron_bridge.py

# release check, not CI: tests/ops, masks, transformer, training on every megatron-core release
# pyproject admits, one venv each under .compat/<version> (docs/compat.md); COMPAT_VERSIONS picks
test-compat:
	$(PYTHON) -m scripts.compat_matrix --python $(PYTHON) --workers $(TEST_WORKERS) $(COMPAT_VERSIONS)

# the CI smoke (.ci/run): dense, MoE, MLA, GDN and hybrid models from the NPU spec on megatron-core
# 0.15.3 and 0.19.2
# (tests/transformer/test_compat_smoke.py); compat-smoke-envs only builds their environments
compat-smoke-envs:
	$(PYTHON) -m scripts.compat_matrix --python $(PYTHON) --smoke --build-only

compat-smoke:
	$(PYTHON) -m scripts.compat_matrix --python $(PYTHON) --smoke --workers 0

# the verl and the Nemotron-H environments alone (CI builds them while `make test` runs)
verl-env: $(VERL_STAMP)

nemotron-env: $(NEMO_STAMP)

# the documentation site (mkdocs.yml) into site/; strict: a broken link or anchor, or a page
# missing from the nav, fails it (CI builds it while `make test` runs)
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(DOCS_BIN)/mkdocs build --strict

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP)
	$(BIN)/mcore-npu bench attention --out bench-out
	$(BIN)/mcore-npu bench mask --out bench-out
	$(BIN)/mcore-npu bench step --out bench-out
	$(BIN)/mcore-npu bench cp --out bench-out

# Mamba2's scan against transformers 5.25's pure-torch one (docs/mamba_ops.md), not CI
bench-ssd: $(NEMO_STAMP)
	$(NEMO_BIN)/mcore-npu bench ssd --out bench-out

# DSA's sparse attention reference against dense masked attention at S=8192, top-k 2048
# (docs/bench.md#dsa-sparse-attention), not CI: about 10 GiB and 1.5 min on 2 cores
bench-dsa: $(STAMP)
	$(BIN)/mcore-npu bench dsa --out bench-out

clean-venv:
	rm -rf $(VENV) $(VERL_VENV) $(NEMO_VENV) $(DOCS_VENV)
