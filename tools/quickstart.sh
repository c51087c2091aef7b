#!/usr/bin/env bash
# The README's quickstart: set up .venv if needed, build the quickstart data from the embedded
# corpora (once), then train the tiny CPLM on CPU (a few minutes on 2 cores) into a fresh
# runs/quickstart-<time>/. Extra arguments are config overrides, e.g. copy.enabled=false for
# the matched baseline, or train.train_steps=100.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
py="${CPLM_VENV:-.venv}/bin/python"
"$py" tools/build_quickstart_data.py --out data/quickstart
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
exec "$py" -m cplm_dist.train --config configs/quickstart.yaml "train.out_dir=runs/quickstart-$(date +%Y%m%d-%H%M%S)" "$@"
