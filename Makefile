# stallfree: the two commands are `make demo` and `make test`.
SHELL := /bin/bash
BAZEL ?= bazel
NVCC := /usr/local/cuda/bin/nvcc
APT_PACKAGES := bazel-bootstrap g++ protobuf-compiler protobuf-compiler-grpc libprotobuf-dev \
  libgrpc++-dev libabsl-dev libtbb-dev libgloo-dev libopenblas-dev libgtest-dev libgmock-dev \
  libbenchmark-dev gnuplot-nox pybind11-dev python3-dev python3.11-venv \
  libsystemd-dev systemd libcivetweb-dev prometheus python3-yaml

# The project's Python: a virtual environment on Debian's python3.11 (the ABI the extension is
# built for) with the pinned packages of python/requirements.txt from PyPI (torch 2.x,
# transformers, accelerate, deepspeed, pytest). Every Python test, example and benchmark runs
# in it; the Python tests find it through $STALLFREE_VENV.
VENV := $(CURDIR)/.venv
VENV_PY := $(VENV)/bin/python
REQUIREMENTS := python/requirements.txt
PY_TEST_ENV := --test_env=STALLFREE_VENV=$(VENV)

# The CUDA backends, their GPU tests and the GPU benchmark (tagged manual: CI builds and links
# them with nvcc; the tests print SKIP without a device).
CUDA_TARGETS := //kernels:optimizer_cuda //kernels:ops_cuda //tests/kernels:optimizer_cuda_test \
  //tests/kernels:ops_cuda_test //bench:gpu_bench //parallel:nccl_communicator //tests/parallel:nccl_test \
  //tests/parallel:tsp_nccl_test //tests/parallel:tpsp_nccl_test //tests/parallel:model_nccl_test \
  //tests/trainer:trainer_cuda_test

# What runs under the sanitizers: the daemon, the client library and the ZenFlow engine.
SANITIZED_TESTS := //tests/server/... //tests/client/... //tests/engine/...
ASAN_FLAGS := --config=asan \
  --test_env=LSAN_OPTIONS=suppressions=$(CURDIR)/tests/sanitizers/lsan.supp
TSAN_FLAGS := --config=tsan \
  --test_env=TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions=$(CURDIR)/tests/sanitizers/tsan.supp

.PHONY: deps apt-deps venv build wheel test test-tsan demo bench gpu-check clean

deps: apt-deps venv

apt-deps:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q "install ok installed" || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing:" $$missing; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	else echo "deps: all packages present"; fi

# Idempotent: the venv is rebuilt only when python/requirements.txt differs from the copy it
# was installed from (a half-made venv has no copy, so an interrupted install starts over).
venv: apt-deps
	@if cmp -s $(REQUIREMENTS) $(VENV)/requirements.installed; then \
	  echo "venv: $(VENV) matches $(REQUIREMENTS)"; \
	else \
	  echo "venv: installing $(REQUIREMENTS) into $(VENV) (torch from PyPI: about 3.5 GB, minutes)"; \
	  rm -f $(VENV)/requirements.installed; \
	  [ -x $(VENV_PY) ] || /usr/bin/python3.11 -m venv $(VENV) || exit 1; \
	  $(VENV_PY) -m pip install --progress-bar off -q -r $(REQUIREMENTS) || exit 1; \
	  cp $(REQUIREMENTS) $(VENV)/requirements.installed; \
	fi

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
	$(BAZEL) test $(ASAN_FLAGS) $(SANITIZED_TESTS)
	$(BAZEL) test $(PY_TEST_ENV) //...
	@if [ -x $(NVCC) ]; then \
	  echo "nvcc found: building and linking the --config=cuda configuration"; \
	  $(BAZEL) build --config=cuda //... $(CUDA_TARGETS) && \
	  ./bazel-bin/tests/kernels/optimizer_cuda_test && ./bazel-bin/tests/kernels/ops_cuda_test && \
	  ./bazel-bin/tests/parallel/nccl_test && ./bazel-bin/tests/parallel/tsp_nccl_test && \
	  ./bazel-bin/tests/parallel/tpsp_nccl_test && ./bazel-bin/tests/parallel/model_nccl_test && \
	  ./bazel-bin/tests/trainer/trainer_cuda_test; \
	else echo "nvcc not found: skipping the CUDA configuration"; fi

test-tsan: deps
	$(BAZEL) test $(TSAN_FLAGS) $(SANITIZED_TESTS)
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
	PYTHONPATH=bazel-bin/python $(VENV_PY) bench/device_bytes_bench.py
	PYTHONPATH=bazel-bin/python $(VENV_PY) bench/quality_suite.py

gpu-check: deps
	BAZEL="$(BAZEL)" ./tests/gpu/gpu_check.sh

clean:
	$(BAZEL) clean
