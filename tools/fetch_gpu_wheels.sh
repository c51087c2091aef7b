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
# lm-eval and what it imports that the image lacks (gpu_check.sh's lm-eval step; ~18 MB, the versions tested here)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl lm-eval==0.4.13 sacrebleu==2.6.0 portalocker==4.4.2 tabulate==0.10.0 colorama==0.4.6 lxml==6.1.3 \
  regex==2026.11.19 pytablewriter==1.2.1 DataProperty==1.1.1 mbstrdecoder==1.1.5 pathvalidate==3.3.1 tabledata==1.3.5 \
  tcolorpy==0.1.7 typepy==1.3.5 chardet==6.0.0.post1 python-dateutil==2.9.0.post0 pytz==2026.6 more-itertools==11.2.1
python3 -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8  # a pure-Python wheel built from its source archive
ls .whl
