#!/usr/bin/env bash
# Runs one pytest file of tests/python against the stallfree package built by Bazel (in the
# test's runfiles), with Debian's /usr/bin/python3 (python3-torch, python3-pytest).
set -euo pipefail
cd "${TEST_SRCDIR}/${TEST_WORKSPACE}"
export STALLFREE_PYTHONPATH="$PWD/python"
# The trainer binary, for the tests that run it (in the runfiles of the rules that depend on it).
if [[ -x trainer/trainer ]]; then export STALLFREE_TRAINER="$PWD/trainer/trainer"; fi
export PYTHONDONTWRITEBYTECODE=1
export HOME="${TEST_TMPDIR:-/tmp}"
unset STALLFREE_SOCKET
exec /usr/bin/python3 -m pytest -q -p no:cacheprovider -o "cache_dir=${TEST_TMPDIR:-/tmp}" "$@"
