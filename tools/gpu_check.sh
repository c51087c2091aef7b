#!/usr/bin/env bash
# The GPU check for one lent H200 (../shared/gpu/README.md): profiles cplm-135m and cplm-1.7b
# (bf16, ZeRO-1 and ZeRO-2, sequence 2048), the copy head's overhead on both, and the memory
# estimator's error; then the copy head alone, dense against chunked (tools/bench_copy_head.py);
# writes JSON per run, profile.csv, table.md and copy_head.md under $OUT.
#
# Here, once:   bash ../shared/gpu/fetch_wheels.sh
# On the device (carry: [".whl"]):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD && bash tools/gpu_check.sh
# On CPU, GPU_CHECK_SMOKE=1 runs the same steps on the tiny config in seconds (tests/test_profile.py).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
: > "$OUT/failures.txt"
if [ -n "${GPU_CHECK_SMOKE:-}" ]; then
  models=(tiny tiny); seq=64; steps=(--warmup 0 --steps 1 --breakdown-steps 1 --rounds 1); micro=(2 2)
  extra=(train.precision=fp32); copy_bench=(--seq-lens 128 --chunk 32 --repeat 1 --hidden 64)
else
  models=(cplm-135m cplm-1.7b); seq=2048; steps=(--warmup 3 --steps 10 --breakdown-steps 2 --rounds 3); micro=(16 8)
  extra=(train.precision=bf16); copy_bench=(--seq-lens 2048 8192 --batch 8 --hidden 2048)
  "$PY" -c "import torch; print(torch.cuda.get_device_name(), torch.__version__, flush=True)" | tee "$OUT/device.txt"
fi
run() {  # name, then cplm_profile.py arguments; a failing run is recorded, the others go on
  local name=$1; shift
  echo "== $name" | tee -a "$OUT/log.txt"
  timeout 600 "$PY" tools/cplm_profile.py "$@" "${steps[@]}" --json "$OUT/$name.json" --csv "$OUT/profile.csv" --label "$name" \
    >> "$OUT/log.txt" 2>&1 || { echo "$name (exit $?)" >> "$OUT/failures.txt"; tail -5 "$OUT/log.txt"; }
}
for i in 0 1; do
  model=${models[$i]}
  common=(--config "$model" "${extra[@]}" "train.micro_batch_size=${micro[$i]}" "model.max_seq_len=$seq" "data.seq_length=$seq")
  for zero in 1 2; do
    run "$model-zero$zero" "${common[@]}" "train.zero_stage=$zero"
  done
  run "$model-copy-overhead" "${common[@]}" train.zero_stage=1 --copy-overhead
done
"$PY" tools/cplm_profile.py --report "$OUT/profile.csv" > "$OUT/table.md"
cat "$OUT/table.md"
echo "== copy head alone" | tee -a "$OUT/log.txt"
timeout 300 "$PY" tools/bench_copy_head.py "${copy_bench[@]}" --json "$OUT/copy_head.json" > "$OUT/copy_head.md" 2>> "$OUT/log.txt" \
  || echo "copy-head bench (exit $?)" >> "$OUT/failures.txt"
cat "$OUT/copy_head.md"
echo "failures: $(wc -l < "$OUT/failures.txt")"
