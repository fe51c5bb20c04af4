#!/usr/bin/env bash
# The Prometheus endpoint with promtool and a real Prometheus (tests/server/metrics_test.py).
set -euo pipefail
for tool in promtool prometheus; do
  command -v "$tool" >/dev/null || { echo "FAIL: $tool is missing (make deps installs prometheus)"; exit 1; }
done
source testing/venv_python.sh
exec "$PYTHON" tests/server/metrics_test.py
