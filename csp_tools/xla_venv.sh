#!/usr/bin/env bash
# Builds the separate environment the XLA tests run in: torch-xla 2.9 needs torch 2.9 (PyPI's CUDA build,
# ~4 GB with its NVIDIA packages), which cannot share the main environment's torch 2.13 CPU build.
# Cached under ~/.cache/nxdt (reused when the versions match); prints the interpreter's path last.
#   bash csp_tools/xla_venv.sh   ->   .../xla-venv/bin/python
set -euo pipefail
VENV="${NXDT_XLA_VENV:-$HOME/.cache/nxdt/xla-venv}"
LOCK="$(cd "$(dirname "$0")/.." && pwd)/constraints.txt"
# The rest at constraints.txt's versions (csp_tools/lock.py), less its torch and triton: this venv's torch is 2.9's,
# which pins its own triton (the lock's is torchtitan's, for torch 2.13).
OWN='^(torch|triton)=='
WANT="torch==2.9.1 torch-xla==2.9.0 lock:$(grep -v -i -E "$OWN" "$LOCK" | sha256sum | cut -c1-16)"
STAMP="$VENV/.nxdt-packages"

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  command -v uv >/dev/null 2>&1 || python3 -m pip install -q --disable-pip-version-check uv >&2
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  uv venv -q "$VENV" --python 3.11 >&2
  # uv resolves and installs the CUDA build of torch in about a minute; pip takes several.
  grep -v -i -E "$OWN" "$LOCK" > "$VENV.constraints"
  VIRTUAL_ENV="$VENV" uv pip install -q -c "$VENV.constraints" torch==2.9.1 torch-xla==2.9.0 \
    numpy pyyaml omegaconf tokenizers tensorboard pytest >&2
  echo "$WANT" > "$STAMP"
fi
echo "$VENV/bin/python"
