#!/usr/bin/env bash
# The Containerfile and the Kubernetes manifests against stallfreed (deploy_files_test.py).
set -euo pipefail
/usr/bin/python3 -c "import yaml" 2>/dev/null || { echo "FAIL: python3-yaml is missing (make deps)"; exit 1; }
exec /usr/bin/python3 tests/deploy/deploy_files_test.py
