# Speculative decoding's cost curve on an H200 (Llama-3-8B shape, random weights), one call under 9 minutes;
# the table is printed last. The acceptance is the bench's SYNTHETIC one (--spec-synthetic-acceptance:
# each guess accepted with probability A while the earlier ones were; outputs not meaningful).
#   bash benchmarks/devrun_spec.sh                    on the device
#   SMOKE=1 PYTHON=/path/to/python bash benchmarks/devrun_spec.sh    the same plumbing on a CPU: the
#       embedded model (jaxserve/assets/tiny-adder), batches 1, 4 and 8, a few tokens, compiling on first use
# Runs (logged under $OUT/work, each under its own timeout and never past DEADLINE, 530 s), most important
# first, every one `jaxserve bench latency --precompile true` (every step shape of its config compiles before
# the timed iterations; later processes find the shared ones in the persistent cache), n-gram k = 4:
#   plain_b1    speculation off, batch 1 (128 in, 128 out)
#   spec_b1     acceptance 0, 0.8, 0.2, 0.5, 0.9 in one engine (A is a step input: nothing recompiles):
#               (a) the verify step's cost at acceptance 0, (b) the speed-up at 0.8
#   draft_b1    the same with a Llama-3.2-1B-shape draft model proposing (configs/models/llama3.2-1b, random
#               weights like the target's), acceptance 0.8, 0.5, 0: (c) the speed-up at 0.8
#   plain_b16, spec_b16, plain_b64, spec_b64    the curve at batch 16 and 64 (128 in, 64 out)
#   spec_b1_sync   batch 1 with overlap off, acceptance 0 and 0.8
#   draft_fp8_b1   draft_b1's draft quantized to FP8 at load (speculative quantization fp8), acceptance 0.8, 0
# Each batch size B runs configs/llama3-8b-dummy.yaml with buckets of its own, so that precompiling is short
# and a verify step is not padded to a larger rung: requests B and B x (k + 1) (max_num_seqs: the scheduler
# takes a guess's logits row from the rows no request holds), tokens B (or 16), B x (k + 1) and B x 128 (the
# prompts in one step; max_num_batched_tokens).
# PATCH=FILE[,FILE...] (any mode) applies those patches to the tree first.
#   bash benchmarks/devrun_spec.sh ab          instead: an A/B in one call (timings at batch 1 differ between
#       machines more than the changes measured): plain_b1 and spec_b1 (acceptance 0 and 0.8) of the tree,
#       then again after each patch of AB_PATCHES (a comma list, applied one after another; default the three
#       host-side patches of benchmarks/experimental), then of the tree again (the drift); a table per tree;
#       AB_ARGS: more bench flags for every run (e.g. "--temperature 0.7": random sampling); AB_RUNS (a comma
#       list of spec and draft, default spec): draft adds draft_b1 (acceptance 0.8 and 0) to each tree
# Then the table (benchmarks/spec_summary.py) to stdout and $OUT/summary.txt, $OUT/summary.json, and every
# log and report in $OUT/spec_logs.tar.gz.
#   bash benchmarks/devrun_spec.sh verify      instead: the attention kernels' GPU tests, then plain_b1, spec_b1,
#       plain_b16 and spec_b16 alone (the verify step's cost and the n-gram curve at batch 1 and 16), and the table
#   bash benchmarks/devrun_spec.sh graphs      instead: XLA's command-buffer log (TF_CPP_VMODULE) of a plain and
#       an n-gram (A = 0) batch-1 run: how many graph executions update allocations (a step whose graph is
#       updated every step pays the update on the host); `graphs plain,ngram,draft` (a comma list) adds the
#       draft model at A = 0.8
#   bash benchmarks/devrun_spec.sh draft       instead: plain_b1, draft_b1 and draft_fp8_b1 alone, and the table;
#       `only plain_b1,spec_b1,draft_fp8_b1` (a comma list of those four): the named ones alone (spec_b1 at
#       acceptance 0 and 0.8)
#   bash benchmarks/devrun_spec.sh profile     instead: where a speculating step's time goes, host and device
#       (benchmarks/profile_step.py --host-top 45 on the batch-1 config, precompiled): speculation off, then
#       n-gram, both with overlap off (every step's host work in series with its device work), n-gram at
#       A = 0 (every guess scored: the verify step's kernels beside the plain step's), then the draft model at
#       A = 0.8; their output in $OUT/profile_*.txt; `profile ngram` (or plain, draft, a comma list): those
#       alone; plain_async and ngram_async (only when named): the same two with overlap on, whose host side
#       (--host-top) is the engine's own dispatch while the previous step runs. (The profiler runs each
#       kernel on its own, without CUDA graphs: its device times hold, its host times are not the graphs'.)
set -o pipefail
OUT=${OUT:-/tmp/devrun_spec}
DEADLINE=${DEADLINE:-530}
source benchmarks/devrun_common.sh
apply() { git apply "$@" || { echo "git apply $* failed"; exit 1; }; }  # (patches of PATCH and the ab mode)
for patch in ${PATCH//,/ }; do apply "$patch"; done
SHOW="^Decode:|^synthetic acceptance|^compiled"
K=4
SPEC="--speculative-config {\"method\":\"ngram\",\"num_speculative_tokens\":$K}"
if [ -n "${SMOKE:-}" ]; then
  DRAFT_DIR=$PWD/jaxserve/assets/tiny-adder-draft
  B1="--input-len 4 --output-len 16" BN="--input-len 4 --output-len 12" BATCHES="4 8"
  cfg() { echo "--precompile false"; }  # the default config (the embedded model), shapes compiled on first use
else
  DRAFT_DIR=$PWD/configs/models/llama3.2-1b
  B1="--input-len 128 --output-len 128" BN="--input-len 128 --output-len 64" BATCHES="16 64"
  # cfg B: the config file of batch size B (written once), as bench flags
  cfg() {
    local b=$1 rows=$(($1 * (K + 1))) prompt=$(($1 * 128)) file=$W/spec_b$1.yaml
    local small=$((b > 16 ? b : 16))
    [ -f "$file" ] || sed -e "s|path: models/llama3-8b|path: $PWD/configs/models/llama3-8b|" \
        -e "s|max_num_seqs: 256|max_num_seqs: $rows|" \
        -e "s|max_num_batched_tokens: 8192|max_num_batched_tokens: $prompt|" \
        -e "s|token_buckets: \[.*\]|token_buckets: [$small, $rows, $prompt]|" \
        -e "s|request_buckets: \[.*\]|request_buckets: [$b, $rows]|" \
        configs/llama3-8b-dummy.yaml > "$file"
    echo "--config $file --precompile true"
  }
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.total --format=csv,noheader
fi
DRAFT="--speculative-config {\"method\":\"draft_model\",\"model\":\"$DRAFT_DIR\",\"num_speculative_tokens\":$K}"
DRAFT_FP8="--speculative-config {\"method\":\"draft_model\",\"model\":\"$DRAFT_DIR\",\"num_speculative_tokens\":$K,\"quantization\":\"fp8\"}"
BENCH="$PY -m jaxserve.cli bench latency --disable-tqdm"
# bench NAME B MAX_S RESERVE_S ARGS...: one bench process at batch size B (run), its report in $W/NAME.json
bench() {
  local name=$1 b=$2 max=$3 reserve=$4; shift 4
  run "$name" "$max" "$reserve" $BENCH $(cfg "$b") --batch-size "$b" "$@" --output-json "$W/$name.json"
}

if [ "${1:-}" = profile ]; then
  PROFILE="$PY benchmarks/profile_step.py $(cfg 1) --disable-tqdm --batch-size 1 $B1 --num-iters-warmup 1 --num-iters 1
    --top 30 --host-top 45"
  ONLY=,${2:-plain,ngram,draft},  # (profile ngram: that one alone)
  [[ $ONLY == *,plain,* ]] && run profile_plain_sync 120 400 $PROFILE --async-scheduling false
  [[ $ONLY == *,ngram,* ]] && run profile_ngram_sync 180 230 $PROFILE $SPEC --async-scheduling false \
    --spec-synthetic-acceptance 0
  [[ $ONLY == *,plain_async,* ]] && run profile_plain_async 120 200 $PROFILE
  [[ $ONLY == *,ngram_async,* ]] && run profile_ngram_async 180 150 $PROFILE $SPEC --spec-synthetic-acceptance 0
  [[ $ONLY == *,draft,* ]] && run profile_draft 230 5 $PROFILE $DRAFT --spec-synthetic-acceptance 0.8
  for name in profile_plain_sync profile_ngram_sync profile_plain_async profile_ngram_async profile_draft; do
    [ -f "$W/$name.log" ] || continue
    grep -v "^W[0-9]\|^I[0-9]" "$W/$name.log" > "$OUT/$name.txt"; tail -25 "$OUT/$name.txt"
  done
  exit 0
fi
if [ "${1:-}" = graphs ]; then  # does XLA update a step's CUDA graph every step? its log, plain and n-gram (A = 0)
  ONLY=,${2:-plain,ngram},
  for name in plain_vlog spec_vlog draft_vlog; do
    case $name in
      plain_vlog) [[ $ONLY == *,plain,* ]] || continue; extra="" ;;
      spec_vlog) [[ $ONLY == *,ngram,* ]] || continue; extra="$SPEC --spec-synthetic-acceptance 0" ;;
      draft_vlog) [[ $ONLY == *,draft,* ]] || continue; extra="$DRAFT --spec-synthetic-acceptance 0.8" ;;
    esac
    (export TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1
     run $name 200 5 $BENCH $(cfg 1) --batch-size 1 $B1 --num-iters-warmup 0 --num-iters 1 $extra)
    echo "== $name: the last 400 graph executions' updates (count, commands, allocations updated)"
    grep -E "command_buffer_thunk|command_executor" "$W/$name.log" | tail -400 \
      | grep -oE "num_commands=[0-9]+; updated_allocs=[0-9]+|Updated [0-9]+ commands" | sort | uniq -c
    grep -E "^Decode:|^step  ms" "$W/$name.log"
  done
  tar -czf "$OUT/spec_logs.tar.gz" -C "$OUT" work
  exit 0
fi
if [ "${1:-}" = ab ]; then  # the tree, then AB_PATCHES added one at a time, then the tree again: plain + n-gram
  x=benchmarks/experimental
  IFS=, read -ra added <<< "${AB_PATCHES:-$x/unrolled_token_requests.patch,$x/greedy_argmax_every_step.patch,$x/ngram_verify_propose.patch}"
  runs=,${AB_RUNS:-spec},
  tree() {  # NAME: plain_b1 and the AB_RUNS of the tree as it is now, in $OUT/NAME
    W=$OUT/$1; mkdir -p "$W"
    bench plain_b1 1 100 20 $B1 --num-iters-warmup 1 --num-iters 3 ${AB_ARGS:-}
    [[ $runs == *,spec,* ]] && bench spec_b1 1 120 20 $B1 --num-iters-warmup 1 --num-iters 3 $SPEC \
      --spec-synthetic-acceptance 0,0.8 ${AB_ARGS:-}
    [[ $runs == *,draft,* ]] && bench draft_b1 1 260 20 $B1 --num-iters-warmup 1 --num-iters 2 $DRAFT \
      --spec-synthetic-acceptance 0.8,0 ${AB_ARGS:-}
  }
  tree a_tree
  for i in "${!added[@]}"; do
    apply "${added[i]}"
    tree "b$((i + 1))_$(basename "${added[i]}" .patch)"
  done
  for ((i = ${#added[@]} - 1; i >= 0; i--)); do apply -R "${added[i]}"; done
  tree c_tree_again
  for d in "$OUT"/a_tree "$OUT"/b*_* "$OUT"/c_tree_again; do
    echo "== $(basename "$d")"; $PY benchmarks/spec_summary.py "$d" | grep -E "^\([abc]\)|^ +1 "
  done | tee "$OUT/summary.txt"
  tar -czf "$OUT/spec_logs.tar.gz" -C "$OUT" $(cd "$OUT" && ls -d a_tree b*_* c_tree_again)
  exit 0
fi
if [ "${1:-}" = draft ] || [ "${1:-}" = only ]; then
  ONLY=,${2:-plain_b1,draft_b1,draft_fp8_b1},
  [[ $ONLY == *,plain_b1,* ]] && bench plain_b1 1 120 300 $B1 --num-iters-warmup 1 --num-iters 3
  [[ $ONLY == *,spec_b1,* ]] && bench spec_b1 1 120 250 $B1 --num-iters-warmup 1 --num-iters 3 $SPEC \
    --spec-synthetic-acceptance 0,0.8
  [[ $ONLY == *,draft_b1,* ]] && bench draft_b1 1 220 150 $B1 --num-iters-warmup 1 --num-iters 2 $DRAFT \
    --spec-synthetic-acceptance 0.8,0
  [[ $ONLY == *,draft_fp8_b1,* ]] && bench draft_fp8_b1 1 300 5 $B1 --num-iters-warmup 1 --num-iters 2 $DRAFT_FP8 \
    --spec-synthetic-acceptance 0.8,0
  tar -czf "$OUT/spec_logs.tar.gz" -C "$OUT" work
  $PY benchmarks/spec_summary.py "$W" --json "$OUT/summary.json" | tee "$OUT/summary.txt"
  rm -rf "$W"
  exit 0
fi
if [ "${1:-}" = verify ]; then
  [ -n "${SMOKE:-}" ] || run gpu_tests 150 300 $PY -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_paged_attention_gpu.py tests/test_fp8_kv.py tests/test_engine_pallas.py
  [ -f "$W/gpu_tests.log" ] && tail -3 "$W/gpu_tests.log"
  bench plain_b1 1 120 200 $B1 --num-iters-warmup 1 --num-iters 3
  bench spec_b1 1 120 100 $B1 --num-iters-warmup 1 --num-iters 3 $SPEC --spec-synthetic-acceptance 0,0.8,0.5
  B=${BATCHES%% *}
  bench plain_b$B "$B" 90 50 $BN --num-iters-warmup 1 --num-iters 2
  bench spec_b$B "$B" 120 5 $BN --num-iters-warmup 1 --num-iters 2 $SPEC --spec-synthetic-acceptance 0.8,0
  tar -czf "$OUT/spec_logs.tar.gz" -C "$OUT" work
  $PY benchmarks/spec_summary.py "$W" --json "$OUT/summary.json" | tee "$OUT/summary.txt"
  rm -rf "$W"
  exit 0
fi
bench plain_b1 1 200 330 $B1 --num-iters-warmup 1 --num-iters 3
bench spec_b1 1 180 230 $B1 --num-iters-warmup 1 --num-iters 3 $SPEC --spec-synthetic-acceptance 0,0.8,0.2,0.5,0.9
bench draft_b1 1 220 150 $B1 --num-iters-warmup 1 --num-iters 2 $DRAFT --spec-synthetic-acceptance 0.8,0.5,0
for B in $BATCHES; do
  bench plain_b$B "$B" 90 60 $BN --num-iters-warmup 1 --num-iters 2
  bench spec_b$B "$B" 120 30 $BN --num-iters-warmup 1 --num-iters 2 $SPEC --spec-synthetic-acceptance 0.8,0.5,0.2,0.9,0
done
bench spec_b1_sync 1 60 100 $B1 --num-iters-warmup 1 --num-iters 2 $SPEC --async-scheduling false \
  --spec-synthetic-acceptance 0,0.8
bench draft_fp8_b1 1 220 5 $B1 --num-iters-warmup 1 --num-iters 2 $DRAFT_FP8 --spec-synthetic-acceptance 0.8,0
echo "== ${SECONDS}s: done"
tar -czf "$OUT/spec_logs.tar.gz" -C "$OUT" work
$PY benchmarks/spec_summary.py "$W" --json "$OUT/summary.json" | tee "$OUT/summary.txt"
rm -rf "$W"
