# Create (or reuse) .venv-kvpress: NVIDIA kvpress 0.5.5 with the dependencies it pins (transformers 5.2), beside
# the project's .venv (whose newer transformers kvpress refuses), and vlkv installed editable without its own
# dependencies. Only kvpress's own entry point needs it (`with press(model)` and its pipeline):
#     bash tools/bench/kvpress_venv.sh
#     .venv-kvpress/bin/python -m vlkv.tools.bench.kvpress_own_path
# Idempotent: installs only when the pins below changed since the last install (a stamp file records them).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VLKV_KVPRESS_VENV:-$ROOT/.venv-kvpress}"
PINS="kvpress==0.5.5 transformers==5.2.* torch==2.13.0 gguf tqdm"
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating virtual environment $VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
STAMP="$VENV/.vlkv-kvpress-installed"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$PINS" ]; then
  echo "installing $PINS into $VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"  # the CPU build on this machine's disk first
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install -q $PINS
  "$VENV/bin/python" -m pip install -q --no-deps -e "$ROOT"
  echo "$PINS" > "$STAMP"
fi
