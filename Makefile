# stallfree: the two commands are `make demo` and `make test`.
SHELL := /bin/bash
BAZEL ?= bazel
NVCC := /usr/local/cuda/bin/nvcc
APT_PACKAGES := bazel-bootstrap g++ protobuf-compiler protobuf-compiler-grpc libprotobuf-dev \
  libgrpc++-dev libabsl-dev libtbb-dev libgloo-dev libopenblas-dev libgtest-dev libgmock-dev \
  libbenchmark-dev gnuplot-nox pybind11-dev python3-dev python3.11-venv \
  libsystemd-dev systemd libcivetweb-dev prometheus python3-yaml libssl-dev

# The project's Python: a virtual environment on Debian's python3.11 (the ABI the extension is
# built for) with the pinned packages of python/requirements.txt from PyPI (torch 2.15,
# transformers, accelerate, deepspeed, pytest). Every Python test, example and benchmark runs
# in it; the Python tests find it through $STALLFREE_VENV. `make test-torch-min` runs the
# Python tests again in .venv-min/, made from python/requirements-min.txt (the oldest torch
# still supported, 2.9.1).
VENV := $(CURDIR)/.venv
VENV_PY := $(VENV)/bin/python
REQUIREMENTS := python/requirements.txt
VENV_MIN := $(CURDIR)/.venv-min
REQUIREMENTS_MIN := python/requirements-min.txt
# The venv is no input Bazel knows of: its requirements file's hash goes into the tests'
# environment, so that a cached Python test result never outlives a change of pins.
py_test_env = --test_env=STALLFREE_VENV=$(1) \
  --test_env=STALLFREE_VENV_PINS=$$(sha256sum < $(2) | cut -c1-16)
PY_TEST_ENV := $(call py_test_env,$(VENV),$(REQUIREMENTS))

# The CUDA backends, their GPU tests and the GPU benchmark (tagged manual: CI builds and links
# them with nvcc; the tests print SKIP without a device).
CUDA_TARGETS := //kernels:optimizer_cuda //kernels:ops_cuda //tests/kernels:optimizer_cuda_test \
  //tests/kernels:ops_cuda_test //bench:gpu_bench //parallel:nccl_communicator //tests/parallel:nccl_test \
  //tests/parallel:tsp_nccl_test //tests/parallel:tpsp_nccl_test //tests/parallel:model_nccl_test \
  //tests/trainer:trainer_cuda_test

# What runs under the sanitizers: the daemon, the client library, the ZenFlow engine, and the
# kill tests of the trainer and of ZenFlowAdamW (the Python suite's survival tests, the
# extension and daemons built with the sanitizers, their runtimes preloaded: run_pytest.sh).
# `make test` runs these under ASan + UBSan only, not again in the plain configuration (the same
# assertions, and the sanitizers' checks besides): the plain run takes the rest of //... (the
# sanitized tests' own binaries are then built in the ASan configuration only).
# `make test-tsan` runs all but the Python suite's under ThreadSanitizer.
TSAN_TESTS := //tests/server/... //tests/client/... //tests/engine/... \
  //tests/common:state_format_test //tests/trainer:trainer_survival_test
SANITIZED_TESTS := $(TSAN_TESTS) //tests/python:survival_test
PLAIN_TESTS := //... $(addprefix -,$(SANITIZED_TESTS))
ASAN_FLAGS := --config=asan \
  --test_env=LSAN_OPTIONS=suppressions=$(CURDIR)/tests/sanitizers/lsan.supp
TSAN_FLAGS := --config=tsan \
  --test_env=TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions=$(CURDIR)/tests/sanitizers/tsan.supp

.PHONY: deps apt-deps venv venv-min build wheel test test-torch-min test-tsan demo bench \
  gpu-check clean

deps: apt-deps venv

apt-deps:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q "install ok installed" || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing:" $$missing; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	else echo "deps: all packages present"; fi

# Idempotent: a venv is made again, from nothing, only when its requirements file differs from
# the copy it was installed from (a half-made venv has no copy, so an interrupted install starts
# over; a change of pins leaves no package of the old ones behind, e.g. torch 2.9's
# nvidia-*-cu12). $(1): the venv, $(2): its requirements file. Only a directory that is a venv
# (pyvenv.cfg) is removed.
define make_venv
	@if cmp -s $(2) $(1)/requirements.installed; then \
	  echo "venv: $(1) matches $(2)"; \
	else \
	  echo "venv: installing $(2) into a new $(1) (torch from PyPI: about 3 GB, minutes)"; \
	  if [ -e $(1) ]; then \
	    [ -f $(1)/pyvenv.cfg ] || { echo "venv: $(1) exists and is no venv; not touching it" >&2; exit 1; }; \
	    rm -rf $(1) || exit 1; \
	  fi; \
	  /usr/bin/python3.11 -m venv $(1) || exit 1; \
	  $(1)/bin/python -m pip install --progress-bar off -q -r $(2) || exit 1; \
	  cp $(2) $(1)/requirements.installed; \
	fi
endef

venv: apt-deps
	$(call make_venv,$(VENV),$(REQUIREMENTS))

venv-min: apt-deps
	$(call make_venv,$(VENV_MIN),$(REQUIREMENTS_MIN))

build: deps
	$(BAZEL) build //:stallfreed //:stallfreectl //...

# dist/stallfree-<version>-cp311-cp311-linux_x86_64.whl: the package of //python:stallfree_package
# (sources, extension, stallfreed, stallfreectl) as a wheel, written by python/build_wheel.py
# (//python:wheel). `pip install` it into any Debian 12 python3.11 environment; it needs the
# system libraries of `make apt-deps` at run time, not the venv.
wheel: apt-deps
	$(BAZEL) build //python:wheel
	@mkdir -p dist && rm -f dist/stallfree-*.whl && \
	  cp bazel-bin/python/wheel/stallfree-*.whl dist/ && chmod 644 dist/stallfree-*.whl && \
	  ls -l dist/stallfree-*.whl

# The sanitizer run comes first: bazel-bin points at the last configuration built, and users
# expect the plain one there after make test.
test: deps
	$(BAZEL) test $(ASAN_FLAGS) $(PY_TEST_ENV) $(SANITIZED_TESTS)
	$(BAZEL) test $(PY_TEST_ENV) -- $(PLAIN_TESTS)
	@if [ -x $(NVCC) ]; then \
	  echo "nvcc found: building and linking the --config=cuda configuration"; \
	  $(BAZEL) build --config=cuda //... $(CUDA_TARGETS) && \
	  ./bazel-bin/tests/kernels/optimizer_cuda_test && ./bazel-bin/tests/kernels/ops_cuda_test && \
	  ./bazel-bin/tests/parallel/nccl_test && ./bazel-bin/tests/parallel/tsp_nccl_test && \
	  ./bazel-bin/tests/parallel/tpsp_nccl_test && ./bazel-bin/tests/parallel/model_nccl_test && \
	  ./bazel-bin/tests/trainer/trainer_cuda_test; \
	else echo "nvcc not found: skipping the CUDA configuration"; fi

# The Python suite (tests/python) with the oldest torch still supported (.venv-min/ from
# python/requirements-min.txt: torch 2.9.1). Not part of `make test`: the second venv (about
# 3 GB downloaded, 2 min) and a second run of the suite (5.5-7.5 min here) would take
# `make test` from a clean clone (15-18 min) past its 20 minutes.
test-torch-min: venv-min
	$(BAZEL) test $(call py_test_env,$(VENV_MIN),$(REQUIREMENTS_MIN)) //tests/python:all

test-tsan: deps
	$(BAZEL) test $(TSAN_FLAGS) $(TSAN_TESTS)
	$(BAZEL) build //...  # bazel-bin back to the plain configuration

# The demo: a GPT in the three modes on the same data, the modeled GPU step times, one plot.
demo: deps
	$(BAZEL) build //:stallfreed //:stallfreectl //:trainer //trainer:compare_runs \
	  //bench:offload_modeled_bench
	./trainer/demo.sh

bench: deps
	$(BAZEL) run //bench:optimizer_bench
	$(BAZEL) run //bench:transport_bench
	$(BAZEL) run //bench:load_bench
	$(BAZEL) run //bench:tsp_bench
	$(BAZEL) run //bench:offload_quality_bench
	$(BAZEL) run //bench:offload_modeled_bench
	$(BAZEL) run //bench:train_bench -- --quick
	$(BAZEL) build //python:stallfree_package
	PYTHONPATH=bazel-bin/python $(VENV_PY) bench/torch_bench.py
	PYTHONPATH=bazel-bin/python $(VENV_PY) bench/dp_bench.py
	PYTHONPATH=bazel-bin/python $(VENV_PY) bench/fsdp2_bench.py
	PYTHONPATH=bazel-bin/python $(VENV_PY) bench/state_dict_bench.py
	PYTHONPATH=bazel-bin/python $(VENV_PY) bench/device_bytes_bench.py
	PYTHONPATH=bazel-bin/python $(VENV_PY) bench/quality_suite.py

gpu-check: deps
	BAZEL="$(BAZEL)" ./tests/gpu/gpu_check.sh

clean:
	$(BAZEL) clean
