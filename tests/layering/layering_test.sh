#!/usr/bin/env bash
# The layering check over the layers' sources in the runfiles (tests/layering/layering_test.py).
set -euo pipefail
source testing/venv_python.sh
exec "$PYTHON" tests/layering/layering_test.py .
