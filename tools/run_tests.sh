#!/usr/bin/env bash
# The README's test command (CI's too): set up .venv if needed, then run the whole suite.
# Extra arguments go to pytest (e.g. `bash tools/run_tests.sh -k vocab_parallel`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
set +e
"${CPLM_VENV:-.venv}/bin/python" -m pytest -q --durations=15 "$@"  # the slowest tests, to keep the suite within budget
rc=$?
set -e
if [ "$rc" -eq 5 ]; then  # pytest: no tests collected -- a suite that tests nothing must not pass
  echo "error: pytest collected no tests (check the path or -k expression)" >&2
  exit 1
fi
exit "$rc"
