# Sourced by the tests written in Python (run from the root of their runfiles): sets PYTHON to
# the project's Python, the virtual environment `make deps` makes ($STALLFREE_VENV, which the
# Makefile passes; else .venv/ of the source tree that this file's runfiles link to), or fails
# the test naming the fix.
venv=${STALLFREE_VENV:-}
if [[ -z "$venv" ]]; then
  src=$(readlink -f testing/venv_python.sh)
  venv="${src%/testing/venv_python.sh}/.venv"
fi
PYTHON="$venv/bin/python"
if [[ ! -x "$PYTHON" ]]; then
  echo "FAIL: no Python environment at $venv: run \`make deps\` (it creates .venv/ from" \
       "python/requirements.txt), or set STALLFREE_VENV to one" >&2
  exit 1
fi
