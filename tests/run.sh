#!/usr/bin/env bash
# The test command: lint, check import contracts and that generated protos are current, run the pytest suite.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../deploy/venv.sh"
cd "$ROOT"
echo "== ruff"
ruff check .
ruff format --check .
echo "== import contracts"
lint-imports
echo "== protos"
python protos/codegen.py --check
echo "== pytest"
exec python -m pytest -q "$@"
