#!/usr/bin/env bash
# The Containerfile and the Kubernetes manifests against stallfreed (deploy_files_test.py).
set -euo pipefail
source testing/venv_python.sh
"$PYTHON" -c "import yaml" 2>/dev/null || { echo "FAIL: PyYAML is missing from $PYTHON (make deps)"; exit 1; }
exec "$PYTHON" tests/deploy/deploy_files_test.py
