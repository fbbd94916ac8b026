# Create (or reuse) .venv-kvpress: NVIDIA kvpress 0.5.5 with the dependencies it pins (transformers 5.2), beside
# the project's .venv (whose newer transformers kvpress refuses), and vlkv and its lab (lab/) installed editable
# without their own dependencies. Only kvpress's own entry point needs it (`with press(model)` and its pipeline):
#     bash lab/vlkv_lab/bench/kvpress_venv.sh
#     .venv-kvpress/bin/python -m vlkv_lab.bench.kvpress_own_path
# Idempotent: installs only when the pins below changed since the last install (a stamp file records them).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"  # lab/vlkv_lab/bench -> the repo
VENV="${VLKV_KVPRESS_VENV:-$ROOT/.venv-kvpress}"
PINS="kvpress==0.5.5 transformers==5.2.* torch==2.13.0 gguf tqdm"
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating virtual environment $VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
STAMP="$VENV/.vlkv-kvpress-installed"
WANT="$PINS vlkv+lab"  # the lab as a package of its own: venvs from before install it too
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
  echo "installing $PINS into $VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"  # the CPU build on this machine's disk first
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install -q $PINS
  "$VENV/bin/python" -m pip install -q --no-deps -e "$ROOT"
  "$VENV/bin/python" -m pip install -q --no-deps -e "$ROOT/lab"
  echo "$WANT" > "$STAMP"
fi
