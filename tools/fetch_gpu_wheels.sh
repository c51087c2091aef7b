#!/usr/bin/env bash
# Wheels for a GPU machine whose image has torch (CUDA) but not this project's other needs, and no
# network: puts them in ./.whl (git-ignored) for tools/gpu_check.sh. Python 3.12 x86-64 targets.
# Usage, from the project root on a machine with PyPI access:   bash tools/fetch_gpu_wheels.sh
# On the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD && bash tools/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl megatron-core==0.16.1 hjson pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection \
  datasets==5.2.0 dill multiprocess
python3 -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8  # a pure-Python wheel built from its source archive
ls .whl
