#!/usr/bin/env bash
# make gpu-check: builds the GPU tests and the GPU benchmark, assembles a self-contained bundle
# (gpu-check-bundle/) that runs on any x86-64 Linux machine with an NVIDIA GPU and the CUDA 13
# runtime, and runs it here if this machine has a GPU.
#
# The bundle holds the binaries, the testdata they read (tests/testdata/torch/...,
# resolved relative to the bundle, which run.sh makes the working directory), the non-system
# shared libraries they link (oneTBB, OpenBLAS, gfortran, Abseil: whatever ldd lists beyond
# glibc, the GCC runtime and CUDA), and run.sh. The CUDA libraries (libcudart, libcublas,
# libcublasLt) are not bundled, since libcublasLt alone is ~540 MB: the machine must have them,
# in /usr/local/cuda/lib64 (the binaries' rpath) or on LD_LIBRARY_PATH. Set
# GPU_CHECK_BUNDLE_CUDA_LIBS=1 to bundle them anyway.
#
# Environment: BAZEL (default: bazel; may carry startup flags, e.g. "bazel --output_base=/x"),
# BAZEL_BUILD_FLAGS (extra build flags, e.g. --symlink_prefix=/).
set -euo pipefail

cd "$(dirname "$0")/../.."
BAZEL=${BAZEL:-bazel}
BUNDLE=gpu-check-bundle
# trainer_cuda_test starts the trainer and stallfreed, so they travel in bin/ beside it.
TARGETS=(//tests/kernels:optimizer_cuda_test //tests/kernels:ops_cuda_test //bench:gpu_bench
  //tests/parallel:nccl_test //tests/parallel:tsp_nccl_test //tests/parallel:tpsp_nccl_test
  //tests/parallel:model_nccl_test //tests/trainer:trainer_cuda_test //trainer:trainer
  //server:stallfreed //python:libstallfree_engine.so)

echo "gpu-check: building ${TARGETS[*]} (--config=cuda)"
# shellcheck disable=SC2086  # BAZEL may hold startup flags
$BAZEL build --config=cuda ${BAZEL_BUILD_FLAGS:-} "${TARGETS[@]}"
# shellcheck disable=SC2086
BIN=$($BAZEL info --config=cuda ${BAZEL_BUILD_FLAGS:-} bazel-bin 2>/dev/null)

rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/bin" "$BUNDLE/lib" "$BUNDLE/tests/testdata" "$BUNDLE/python/stallfree" \
  "$BUNDLE/tests/python" "$BUNDLE/include"
# The PyTorch front-end: the package's Python files, the engine facade library (CUDA backend),
# stallfreed, and the binding's source, which run.sh compiles there against that machine's own
# Python (the GPU machine's PyTorch is not Debian's).
cp python/stallfree/*.py "$BUNDLE/python/stallfree/"
cp python/_stallfree.cc python/engine_api.h "$BUNDLE/python/"
cp tests/python/*.py "$BUNDLE/tests/python/"
cp tests/gpu/hf_causal_lm.py tests/gpu/hf_memory.py "$BUNDLE/tests/python/"
cat >"$BUNDLE/python/build_binding.sh" <<'BUILD_SH'
#!/usr/bin/env bash
# Compiles the binding (_stallfree.cc, over engine_api.h) against python3 (or $1) and links it to
# libstallfree_engine.so beside the package, then imports it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
inc=$("$PY" -m pybind11 --includes 2>/dev/null) ||
  inc="-Iinclude $("$PY" -c 'import sysconfig; print("-I" + sysconfig.get_paths()["include"])')"
suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
# shellcheck disable=SC2086  # $inc holds several flags
g++ -O2 -std=c++17 -shared -fPIC -fvisibility=hidden $inc -I. python/_stallfree.cc \
  -o "python/stallfree/_stallfree$suffix" -Lpython/stallfree -lstallfree_engine \
  -Wl,-rpath,'$ORIGIN'
PYTHONPATH=python "$PY" -c "import stallfree; assert stallfree.cuda_enabled; print('stallfree', stallfree.__file__, 'with the CUDA backend')"
BUILD_SH
cp -r /usr/include/pybind11 "$BUNDLE/include/"  # used only if that Python has no pybind11
for t in "${TARGETS[@]}"; do
  path=${t#//}
  path=${path/://}
  case $path in
    *.so) dest="$BUNDLE/python/stallfree" ;;
    *) dest="$BUNDLE/bin" ;;
  esac
  cp -L "$BIN/$path" "$dest/"
  chmod u+w "$dest/$(basename "$path")"
done
cp "$BUNDLE/bin/stallfreed" "$BUNDLE/python/stallfree/"
# The testdata, from the test's runfiles (exactly what Bazel gives it).
cp -rL "$BIN/tests/kernels/optimizer_cuda_test.runfiles/stallfree/tests/testdata/torch" \
  "$BUNDLE/tests/testdata/"

# Shared libraries: everything ldd resolves except glibc, the dynamic loader, the GCC runtime
# (libstdc++, libgcc_s: forward compatible, and the target's own must serve its glibc) and the
# CUDA / driver libraries.
system_lib='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|libpthread\.|librt\.|libresolv\.|libutil\.'
system_lib+='|libstdc\+\+\.|libgcc_s\.)'
cuda_lib='^(libcuda\.|libcudart|libcublas|libnccl|libnvidia|libnvrtc|libnvJitLink)'
missing=0
for b in "$BUNDLE"/bin/* "$BUNDLE"/python/stallfree/libstallfree_engine.so; do
  while read -r name arrow target _; do
    [[ "$arrow" == "=>" ]] || continue
    if [[ "$target" == "not" ]]; then
      echo "gpu-check: $(basename "$b") needs $name, which ldd does not find here" >&2
      missing=1
      continue
    fi
    [[ "$name" =~ $system_lib ]] && continue
    if [[ "$name" =~ $cuda_lib ]]; then
      [[ "${GPU_CHECK_BUNDLE_CUDA_LIBS:-0}" == 1 && "$name" != libcuda.* ]] || continue
    fi
    [[ -e "$BUNDLE/lib/$name" ]] || cp -L "$target" "$BUNDLE/lib/$name"
  done < <(ldd "$b")
done
if [[ $missing != 0 ]]; then
  echo "gpu-check: unresolved libraries (above); the bundle would be incomplete" >&2
  exit 1
fi

cat >"$BUNDLE/run.sh" <<'RUN_SH'
#!/usr/bin/env bash
# Runs the stallfree GPU checks in this bundle: the CUDA optimizer kernel test, the CUDA ops
# test, the GPU benchmark, the NCCL test, the TSP-, TP+SP- and TP x CP-on-NCCL tests, the
# model-on-NCCL test, the trainer on GPUs (bin/trainer with bin/stallfreed), then the PyTorch
# front-end: the binding compiled against this machine's python3 (torch_build), the pytest
# suite on CUDA tensors (torch_tests) and a Hugging Face causal LM trained with ZenFlowAdamW
# (hf_causal_lm) and the device memory of a bf16 model's step against AdamW's (hf_memory), each
# under a timeout (860 s in all; `run.sh NAME...` runs only those
# checks, e.g. `run.sh torch_build torch_tests hf_causal_lm`). Needs an
# NVIDIA GPU, its driver (CUDA 13 or newer) and the CUDA 13 runtime, cuBLAS and NCCL
# (/usr/local/cuda/lib64, or on LD_LIBRARY_PATH). Exit status 0 when every check passed. A check
# that says SKIP passes only where nvidia-smi lists no GPU: on a machine where it lists one, a
# SKIP means the device is there but unusable (a broken driver, a runtime that does not match)
# and fails the run, except a multi-device case skipped because only one GPU is listed.
# GPU_CHECK_LOG_DIR=<dir> also writes each binary's output to <dir>/<name>.log.
set -u
cd "$(dirname "$0")"
export LD_LIBRARY_PATH="$PWD/lib:${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"
LOG_DIR=${GPU_CHECK_LOG_DIR:-}
[[ -n "$LOG_DIR" ]] && mkdir -p "$LOG_DIR"
# The GPUs nvidia-smi lists: with any, a check may not skip for want of a device.
gpus=0
if command -v nvidia-smi >/dev/null; then
  nvidia-smi -L
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU") || gpus=0
fi
failed=0
summary=()
only=("$@")
# run NAME LIMIT [COMMAND...]: COMMAND defaults to bin/NAME.
run() {
  local name=$1 limit=$2
  shift 2
  local cmd=("$@")
  [[ ${#cmd[@]} == 0 ]] && cmd=("bin/$name")
  if [[ ${#only[@]} -gt 0 && " ${only[*]} " != *" $name "* ]]; then return; fi
  local log=${LOG_DIR:+$LOG_DIR/$name.log} tmp_log=""
  if [[ -z "$log" ]]; then
    tmp_log=$(mktemp "${TMPDIR:-/tmp}/gpu-check-$name.XXXXXX")
    log=$tmp_log
  fi
  echo "=== $name (timeout ${limit}s)"
  if [[ -x "bin/$name" ]] && ldd "bin/$name" | grep -q "not found"; then
    echo "$name: missing shared libraries:"
    ldd "bin/$name" | grep "not found"
    summary+=("FAIL $name (missing libraries)")
    failed=1
    return
  fi
  local start=$SECONDS rc
  timeout --kill-after=10 "$limit" "${cmd[@]}" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  local took=$((SECONDS - start))
  if [[ $rc == 0 ]]; then
    # A SKIP the listed GPUs do not explain: any with a GPU listed, but a multi-device case
    # ("need(s) 2 devices") where only one is.
    local unexplained
    unexplained=$(grep "^SKIP" "$log" 2>/dev/null |
      { if [[ $gpus == 1 ]]; then grep -Ev "needs? 2 devices"; else cat; fi; } || true)
    if [[ $gpus -gt 0 && -n "$unexplained" ]]; then
      summary+=("FAIL $name (said SKIP, but nvidia-smi lists $gpus GPU(s): ${unexplained%%$'\n'*})")
      failed=1
    elif grep -q "^SKIP" "$log" 2>/dev/null; then
      summary+=("SKIP $name (${took}s)")
    else
      summary+=("PASS $name (${took}s)")
    fi
  elif [[ $rc == 124 || $rc == 137 ]]; then
    summary+=("FAIL $name (timed out after ${limit}s)")
    failed=1
  else
    summary+=("FAIL $name (exit status $rc, ${took}s)")
    failed=1
  fi
  [[ -z "$tmp_log" ]] || rm -f "$tmp_log"
}
run optimizer_cuda_test 70
run ops_cuda_test 70
run gpu_bench 70
run nccl_test 40
run tsp_nccl_test 40
run tpsp_nccl_test 40
run model_nccl_test 60
run trainer_cuda_test 120
# The PyTorch front-end on this machine's python3 (its own PyTorch, CUDA build).
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/python" PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
run torch_build 120 bash python/build_binding.sh "$PY"
run torch_tests 150 bash -c 'if ! "$0" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "SKIP: $0 sees no CUDA device"; exit 0; fi
  STALLFREE_TEST_DEVICE=cuda exec "$0" -m pytest -q -p no:cacheprovider \
  tests/python/test_adamw_equivalence.py tests/python/test_errors.py \
  tests/python/test_state_dict.py tests/python/test_torch2.py' "$PY"
run fsdp2_cuda 120 bash -c 'exec "$0" -m pytest -q -p no:cacheprovider -k cuda \
  tests/python/test_fsdp2.py' "$PY"
run hf_causal_lm 90 "$PY" tests/python/hf_causal_lm.py
run hf_memory 90 "$PY" tests/python/hf_memory.py
echo "=== summary"
printf '%s\n' "${summary[@]}"
exit $failed
RUN_SH
chmod +x "$BUNDLE/run.sh"

echo "gpu-check: bundle $BUNDLE/ ($(du -sh "$BUNDLE" | cut -f1)):"
(cd "$BUNDLE" && ls -l run.sh bin lib | sed 's/^/  /' &&
  echo "  tests/testdata/torch: $(find tests/testdata/torch -type f | wc -l) files")

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then
  echo "gpu-check: GPU found; running the bundle"
  exec "./$BUNDLE/run.sh"
fi
echo "gpu-check: no GPU here (nvidia-smi -L finds none), so nothing was run."
echo "  On a machine with an NVIDIA GPU, the CUDA 13 driver and CUDA 13 libraries, run:"
echo "    $BUNDLE/run.sh      (copy the whole $BUNDLE/ directory; it cds into itself)"
