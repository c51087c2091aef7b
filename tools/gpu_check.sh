#!/usr/bin/env bash
# The GPU check for one lent H200 (docs/benchmarks.md, "GPU"): the card's bf16 matrix-product and
# copy ceilings, then cplm-135m and cplm-1.7b (bf16, sequence 2048): throughput, MFU, memory against
# the estimator, train.compile on and off, the copy head's overhead in training and in KV-cache
# decoding, the copy head alone (dense, chunked and the fused flex kernel, values and gradients
# checked against dense: tools/bench_copy_head.py --check; a passing flex is recorded in
# cplm_dist/model/flex_gpu_record.json, printed at the end of copy_head.md, and from then on
# copy.impl=auto trains flex on CUDA, in this check's later runs too; until then chunked), the
# chunked LM loss, ZeRO-2, Muon (optim.name=muon) beside AdamW and transformers' Llama on the same shapes.
# Runs go most valuable first under one time budget (GPU_CHECK_BUDGET_S, default 420 s): a run
# that would start past it is recorded as skipped, a failing run is recorded and the others go on.
#
# Then evaluate / generate / lm-eval on a quickstart checkpoint trained there, and the lm-eval
# adapter's requests/s.
# Under $OUT (at most 8 files come back from the device): device.txt, log.txt, table.md,
# copy_head.md, decode.md, lm_eval.md, failures.txt, results.tar.gz (each run's JSON, profile.csv,
# copy_head.json, a Chrome trace of one cplm-135m step, the evaluation's and lm-eval's outputs).
#
# Here, once:   bash tools/fetch_gpu_wheels.sh
# On the device (carry: [".whl"]):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD && bash tools/gpu_check.sh
# On CPU, GPU_CHECK_SMOKE=1 runs the same steps on the tiny config in seconds (tests/test_profile.py);
# it leaves out compilation (tests/test_train.py covers it), the copy-head bench (its own test) and the peer.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-420}
mkdir -p "$OUT"
work=$(mktemp -d)
: > "$OUT/failures.txt"
: > "$OUT/log.txt"
if [ -n "${GPU_CHECK_SMOKE:-}" ]; then
  small=tiny; large=; seq=64; steps=(--warmup 0 --steps 1 --breakdown-steps 1 --rounds 1); micro_small=2
  extra=(train.precision=fp32); copy_bench=()  # the bench's own test runs it on CPU
  decode=(--decode-batches 1 --decode-prompts 16 --new-tokens 4 --no-compile); trace=()  # compiling: test_decoding.py
else
  small=cplm-135m; large=cplm-1.7b; seq=2048; steps=(--warmup 3 --steps 10 --breakdown-steps 2 --rounds 3); micro_small=16
  extra=(train.precision=bf16); copy_bench=(--seq-lens 2048 8192 --batch 8 --hidden 2048 --vocab 64 --impls dense chunked flex --check 1e-3 --record-flex)
  decode=(--decode-batches 1 8 --decode-prompts 512 2048 --new-tokens 64 model.max_seq_len=2112 --peer --decode-eager); trace=(--trace "$work/trace-135m.json")
  { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
    "$PY" tools/gpu_ceiling.py; } 2>&1 | tee "$OUT/device.txt"
fi
left() { echo $((BUDGET - SECONDS)); }
run() {  # name, the run's own cap in seconds, then cplm_profile.py arguments
  local name=$1 cap=$2 t; shift 2
  t=$(left); ((t > cap)) && t=$cap
  if ((t < 30)); then echo "$name (skipped: ${BUDGET} s budget spent)" >> "$OUT/failures.txt"; return; fi
  echo "== $name (at ${SECONDS} s, cap ${t} s)" | tee -a "$OUT/log.txt"
  timeout "$t" "$PY" tools/cplm_profile.py --accumulation 1 "$@" "${steps[@]}" --json "$work/$name.json" --csv "$work/profile.csv" --label "$name" \
    >> "$OUT/log.txt" 2>&1 || { echo "$name (exit $?)" >> "$OUT/failures.txt"; tail -5 "$OUT/log.txt"; }
}
shape() { echo --config "$1" "${extra[@]}" "train.micro_batch_size=$2" "model.max_seq_len=$seq" "data.seq_length=$seq"; }
# The copy head alone, first: every run below trains it with copy.impl=auto, which is the flex
# kernel on CUDA once the bench has recorded it (--record-flex: flex matched dense), chunked before.
# If flex differs from dense or fails (exit 1 or 2), the rest runs copy.impl=chunked; a timeout
# (124) only says the bench ran out of time.
t=$(left); ((t > 180)) && t=180
if ((${#copy_bench[@]} == 0)); then
  :
elif ((t >= 30)); then
  echo "== copy head alone (at ${SECONDS} s)" | tee -a "$OUT/log.txt"
  timeout "$t" "$PY" tools/bench_copy_head.py "${copy_bench[@]}" --json "$work/copy_head.json" > "$OUT/copy_head.md" 2>> "$OUT/log.txt"
  rc=$?
  if ((rc == 124)); then
    echo "copy-head bench (timed out after ${t} s)" >> "$OUT/failures.txt"
  elif ((rc != 0)); then
    echo "copy-head bench (exit $rc): the remaining runs use copy.impl=chunked" >> "$OUT/failures.txt"; extra+=(copy.impl=chunked)
  elif [ -f cplm_dist/model/flex_gpu_record.json ]; then  # it comes back in copy_head.md: commit it as that file
    { echo; echo "flex recorded (commit as cplm_dist/model/flex_gpu_record.json):"; echo '```json'
      cat cplm_dist/model/flex_gpu_record.json; echo '```'; } >> "$OUT/copy_head.md"
  fi
else
  echo "copy-head bench (skipped: ${BUDGET} s budget spent)" >> "$OUT/failures.txt"
fi
run "$small-zero1" 120 $(shape $small $micro_small) train.zero_stage=1 "${trace[@]}"
if [ ! -f "$work/$small-zero1.json" ]; then  # the GPU defaults failed: the rest runs on the earlier settings
  extra+=(optim.impl=foreach train.overlap_comm=false)
  echo "falling back to ${extra[*]} for the remaining runs" | tee -a "$OUT/failures.txt"
fi
# Muon beside the AdamW run: bf16 Newton-Schulz on CUDA, the optimizer's share of the step (optimizer_share)
run "$small-muon-zero1" 120 $(shape $small $micro_small) train.zero_stage=1 optim.name=muon
if [ -n "$large" ]; then
  run "$large-zero1" 150 $(shape $large 8) train.zero_stage=1
  run "$large-muon-zero1" 150 $(shape $large 8) train.zero_stage=1 optim.name=muon
  run "$large-zero1-compile" 240 $(shape $large 8) train.zero_stage=1 train.compile=true
  run "$large-copy-overhead-compile" 240 $(shape $large 8) train.zero_stage=1 train.compile=true --copy-overhead
fi
run "$small-copy-overhead" 120 $(shape $small $micro_small) train.zero_stage=1 --copy-overhead
run "$small-decode" 150 $(shape $small 1) "${decode[@]}" --decode --rounds 2
[ -f "$work/$small-decode.json" ] && "$PY" -c "import json, sys; from cplm_dist.profiling.decoding import markdown
print(markdown(json.load(open(sys.argv[1]))['points']))" "$work/$small-decode.json" > "$OUT/decode.md"
# Evaluation on the GPU: every path that makes tensors for the model (evaluate, generate, the
# lm-eval adapter through the harness) on a checkpoint trained here (GPU_CHECK_EVAL_CHECKPOINT: one
# already made), then the adapter's requests/s at batch 1 and 16 (lm_eval.md).
step() {  # name, then the command; the log gets its output, failures.txt a failing step
  local name=$1 t; shift
  t=$(left); ((t > 120)) && t=120
  if ((t < 20)); then echo "$name (skipped: ${BUDGET} s budget spent)" >> "$OUT/failures.txt"; return 1; fi
  echo "== $name (at ${SECONDS} s)" | tee -a "$OUT/log.txt"
  timeout "$t" "$@" >> "$OUT/log.txt" 2>&1 || { echo "$name (exit $?)" >> "$OUT/failures.txt"; tail -5 "$OUT/log.txt"; return 1; }
}
if [ -n "${GPU_CHECK_SMOKE:-}" ]; then lm_eval_limit=2; bench=(--docs 2 --batch-sizes 1 2); else lm_eval_limit=40; bench=(--docs 50 --batch-sizes 1 16); fi
ck=${GPU_CHECK_EVAL_CHECKPOINT:-$work/eval-run}
if [ -z "${GPU_CHECK_EVAL_CHECKPOINT:-}" ]; then
  { [ -f data/quickstart/tokenizer.model ] || step "quickstart data" "$PY" tools/build_quickstart_data.py; } &&
    step "train for evaluation" "$PY" -m cplm_dist.train --config configs/quickstart.yaml train.train_steps=60 \
      train.save_interval=60 train.eval_interval=1000 train.log_interval=20 "train.out_dir=$ck"
fi
if [ -d "$ck" ] && [ -z "${GPU_CHECK_SMOKE:-}" ]; then  # on CPU, tests/test_evaluation.py runs these two commands
  step "evaluate" "$PY" tools/evaluate.py --checkpoint "$ck" --samples 4 --valid-batches 2 --out "$work/eval"
  step "generate" "$PY" tools/generate.py --checkpoint "$ck" --prompt "Items: plon, fa, ber. The items again:" \
    --max-new-tokens 8 --mark-copies
fi
if [ -d "$ck" ]; then
  step "lm-eval" "$PY" tools/lm_eval_cplm.py --checkpoint "$ck" --tasks cplm_kv_mc cplm_phonebook_gen \
    --limit "$lm_eval_limit" --batch-size 16 --output-path "$work/lm_eval"
  step "lm-eval requests/s" "$PY" tools/bench_lm_eval.py --checkpoint "$ck" "${bench[@]}" --json "$work/lm_eval_bench.json" \
    && grep -E "^batch" "$OUT/log.txt" | tail -6 > "$OUT/lm_eval.md"
fi
if [ -n "$large" ]; then
  run "$large-compile-chunked-loss" 180 $(shape $large 8) train.zero_stage=1 train.compile=true loss.impl=chunked
  run "$large-copy-overhead-compile-chunked-copy" 240 $(shape $large 8) train.zero_stage=1 train.compile=true \
    copy.impl=chunked --copy-overhead
  run "$large-zero2" 120 $(shape $large 8) train.zero_stage=2
  run "$small-peer" 120 $(shape $small $micro_small) train.zero_stage=1 --peer
else
  run "$small-chunked-loss" 120 $(shape $small $micro_small) train.zero_stage=2 loss.impl=chunked loss.chunk_rows=32
fi
[ -f "$work/profile.csv" ] && "$PY" tools/cplm_profile.py --report "$work/profile.csv" > "$OUT/table.md"
tar -czf "$OUT/results.tar.gz" -C "$work" .
cat "$OUT/table.md" "$OUT/decode.md" "$OUT/copy_head.md" "$OUT/lm_eval.md" 2>/dev/null
echo "failures: $(wc -l < "$OUT/failures.txt") (total ${SECONDS} s)"
cat "$OUT/failures.txt"
