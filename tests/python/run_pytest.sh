#!/usr/bin/env bash
# Runs one pytest file of tests/python against the stallfree package built by Bazel (in the
# test's runfiles), with the project's Python (testing/venv_python.sh: the virtual
# environment `make deps` makes).
set -euo pipefail
cd "${TEST_SRCDIR}/${TEST_WORKSPACE}"
source testing/venv_python.sh
export STALLFREE_PYTHONPATH="$PWD/python"
# The trainer binary, for the tests that run it (in the runfiles of the rules that depend on it).
if [[ -x trainer/trainer ]]; then export STALLFREE_TRAINER="$PWD/trainer/trainer"; fi
# Under --config=asan (make test's sanitized run) the extension is built with AddressSanitizer
# and UBSan, and so is the stallfreed it starts: their runtimes go first into every Python
# process (LD_PRELOAD, inherited by the ranks and daemons it starts), leak checking off (the
# interpreter's objects live until exit by design; a daemon's leaks are checked where the C++
# tests stop one by SIGTERM). conftest.py then fails the run on a sanitizer's report in any
# daemon's log.
sanitizer_libs=$(ldd python/stallfree/_stallfree.so 2>/dev/null |
  awk '$1 ~ /^lib(asan|ubsan)\.so/ { print $3 }' | tr '\n' ' ')
if [[ -n "${sanitizer_libs// /}" ]]; then
  export LD_PRELOAD="${sanitizer_libs% }" STALLFREE_SANITIZED=1
  export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1"
fi
export PYTHONDONTWRITEBYTECODE=1
export HOME="${TEST_TMPDIR:-/tmp}"
# Nothing of Hugging Face's reaches the network or the user's cache.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export HF_HOME="${TEST_TMPDIR:-/tmp}/hf" WANDB_DISABLED=true DS_ACCELERATOR=cpu
unset STALLFREE_SOCKET
exec "$PYTHON" -m pytest -q -p no:cacheprovider "$@"
