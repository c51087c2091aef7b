#!/usr/bin/env bash
# The README's quickstart: set up .venv if needed, then build the tiny CPLM on CPU and run a
# forward and backward pass, printing its loss (training on the embedded corpus joins here when
# the training loop lands). Extra arguments are config overrides, e.g. copy.mix=joint.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
exec "${CPLM_VENV:-.venv}/bin/python" tools/model_check.py --config tiny "$@"
