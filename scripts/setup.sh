#!/usr/bin/env bash
# Set up a fresh machine for tridist: PyTorch first, then Triton, then this package with its extras.
#
# torch goes first on purpose: on a CPU-only machine, resolving an unpinned `torch` from a registry
# pulls a multi-GB CUDA build. TORCH_SPEC defaults to the CPU build that lies on this project's
# development machines; an already-installed torch (a GPU machine's CUDA build) is kept as is.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
# Triton 3.8 is the release paired with torch 2.13; CUDA builds of torch bring their own Triton.
TRITON_SPEC=${TRITON_SPEC:-triton==3.8.0}

pip_install() { "$PYTHON" -m pip install --quiet --disable-pip-version-check "$@"; }

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  echo "setup: installing $TORCH_SPEC" >&2
  pip_install "$TORCH_SPEC"
fi
if ! "$PYTHON" -c "import triton" 2>/dev/null; then
  echo "setup: installing $TRITON_SPEC (Triton's interpreter runs the kernels on a CPU)" >&2
  pip_install "$TRITON_SPEC"
fi
echo "setup: installing tridist (editable) with its test extras" >&2
# pip's isolated build (not --no-build-isolation): a fresh virtualenv's own setuptools (65 on Python
# 3.11) cannot build an editable wheel without the `wheel` package; the isolated build brings a current one.
pip_install -e ".[test]"
# pyenv only sees new console scripts (`tridist`) after a rehash.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
"$PYTHON" -c "import torch, triton; print(f'setup: torch {torch.__version__}, triton {triton.__version__}, cuda={torch.cuda.is_available()}')" >&2
