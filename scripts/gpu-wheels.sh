#!/usr/bin/env bash
# Download, into .whl/, the wheels that `tridist bench all` needs on a GPU machine that has torch,
# Triton, pandas and matplotlib but no package registry: Optuna (the kernel sweep) with the
# dependencies such images lack, Liger-Kernel (the peer in the kernel and model benchmarks) and transformers
# with the dependencies a torch image lacks (the model benchmark's hf-model target; numpy, packaging,
# typing-extensions, filelock and fsspec come with torch).
# Run it here (where pip reaches a registry); carry .whl/ to the GPU machine and there run:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   python3 -m pip install -q --no-deps --no-build-isolation -e .
#   python3 -m tridist bench all --out bench/results/<device>-<date>
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}  # the GPU machine's Python
WHEELS=${WHEELS:-"optuna==5.0.0 alembic sqlalchemy mako colorlog greenlet liger-kernel \
  transformers==5.24.0 huggingface-hub tokenizers safetensors regex tqdm pyyaml typer click shellingham rich \
  markdown-it-py mdurl pygments annotated-doc hf-xet httpx2 httpcore2 h11 anyio idna truststore pydantic \
  pydantic-core annotated-types typing-inspection"}
rm -rf .whl && mkdir -p .whl
# shellcheck disable=SC2086
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl $WHEELS
ls -1 .whl
