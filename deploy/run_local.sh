#!/usr/bin/env bash
# The main job: a local vlkv cluster (Ray-placed prefill and decode workers + gateway) on the embedded
# default model, answering synthetic visual questions through the public gRPC API, then shutting down.
# It compresses at 10% by default (verified compression: no policy named) and ends with a summary against
# the full cache. Extra
# arguments go to `vlkv demo` (e.g. --budget 0.05, --policy full, -n 16).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
cd "$ROOT"
exec vlkv demo "$@"
