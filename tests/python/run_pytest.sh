#!/usr/bin/env bash
# Runs one pytest file of tests/python against the stallfree package built by Bazel (in the
# test's runfiles), with the project's Python: the virtual environment `make deps` makes
# ($STALLFREE_VENV, which the Makefile passes; else .venv/ of the source tree these runfiles
# link to).
set -euo pipefail
cd "${TEST_SRCDIR}/${TEST_WORKSPACE}"
venv=${STALLFREE_VENV:-}
if [[ -z "$venv" ]]; then
  src=$(readlink -f tests/python/run_pytest.sh)
  venv="${src%/tests/python/run_pytest.sh}/.venv"
fi
if [[ ! -x "$venv/bin/python" ]]; then
  echo "FAIL: no Python environment at $venv: run \`make deps\` (it creates .venv/ from" \
       "python/requirements.txt), or set STALLFREE_VENV to one" >&2
  exit 1
fi
export STALLFREE_PYTHONPATH="$PWD/python"
# The trainer binary, for the tests that run it (in the runfiles of the rules that depend on it).
if [[ -x trainer/trainer ]]; then export STALLFREE_TRAINER="$PWD/trainer/trainer"; fi
export PYTHONDONTWRITEBYTECODE=1
export HOME="${TEST_TMPDIR:-/tmp}"
# Nothing of Hugging Face's reaches the network or the user's cache.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export HF_HOME="${TEST_TMPDIR:-/tmp}/hf" WANDB_DISABLED=true DS_ACCELERATOR=cpu
unset STALLFREE_SOCKET
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider -o "cache_dir=${TEST_TMPDIR:-/tmp}" "$@"
