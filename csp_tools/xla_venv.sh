#!/usr/bin/env bash
# Builds the separate environment the XLA tests run in: torch-xla 2.9 needs torch 2.9 (PyPI's CUDA build,
# ~4 GB with its NVIDIA packages), which cannot share the main environment's torch 2.13 CPU build.
# Cached under ~/.cache/nxdt (reused when the versions match); prints the interpreter's path last.
#   bash csp_tools/xla_venv.sh   ->   .../xla-venv/bin/python
set -euo pipefail
VENV="${NXDT_XLA_VENV:-$HOME/.cache/nxdt/xla-venv}"
WANT="torch==2.9.1 torch-xla==2.9.0"
STAMP="$VENV/.nxdt-packages"

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  command -v uv >/dev/null 2>&1 || python3 -m pip install -q --disable-pip-version-check uv >&2
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  uv venv -q "$VENV" --python 3.11 >&2
  # uv resolves and installs the CUDA build of torch in about a minute; pip takes several.
  VIRTUAL_ENV="$VENV" uv pip install -q $WANT numpy pyyaml omegaconf tokenizers tensorboard pytest >&2
  echo "$WANT" > "$STAMP"
fi
echo "$VENV/bin/python"
