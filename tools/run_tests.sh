#!/usr/bin/env bash
# The README's test command (CI's too): set up .venv if needed, then run the whole suite on two
# pytest-xdist workers (tests/scheduling.py: a module is a unit, the Slurm / multi-host modules one
# unit together, longest first).
#   bash tools/run_tests.sh               the whole suite (what CI runs)
#   bash tools/run_tests.sh --quick       the quick tier: everything not marked `slow` (a developer's loop)
#   bash tools/run_tests.sh -k vocab_parallel     extra arguments go to pytest
# CPLM_TEST_WORKERS=N sets the number of workers (0: one process, no xdist).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
args=()
for a in "$@"; do
  if [ "$a" = "--quick" ]; then args+=(-m "not slow"); else args+=("$a"); fi
done
workers=${CPLM_TEST_WORKERS:-2}
py="${CPLM_VENV:-.venv}/bin/python"
parallel=()
if [ "$workers" != 0 ] && "$py" -c "import xdist" 2>/dev/null; then
  parallel=(-n "$workers" --no-loadscope-reorder)
fi
set +e
"$py" -m pytest -q --durations=15 "${parallel[@]}" "${args[@]}"  # the slowest tests, to keep the suite within budget
rc=$?
set -e
if [ "$rc" -eq 5 ]; then  # pytest: no tests collected -- a suite that tests nothing must not pass
  echo "error: pytest collected no tests (check the path or -k expression)" >&2
  exit 1
fi
exit "$rc"
