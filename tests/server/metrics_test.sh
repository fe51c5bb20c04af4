#!/usr/bin/env bash
# The Prometheus endpoint with promtool and a real Prometheus (tests/server/metrics_test.py).
set -euo pipefail
for tool in promtool prometheus; do
  command -v "$tool" >/dev/null || { echo "FAIL: $tool is missing (make deps installs prometheus)"; exit 1; }
done
exec /usr/bin/python3 tests/server/metrics_test.py
