# FP8 weights, FP8 KV cache and long-prompt prefill on an H200 (Llama-3-8B shape, random weights), one call
# under 9 minutes; the table is printed last.
#   bash benchmarks/devrun_fp8.sh [all|weights|long|kv|throughput|throughput_fp8|throughput_tuned|fp8_prefill|kernel]
#       on the device (default: all)
#   SMOKE=1 PYTHON=/path/to/python bash benchmarks/devrun_fp8.sh [MODE]    the same plumbing on a CPU: the
#       embedded model (jaxserve/assets/tiny-adder, float32), tiny shapes, a couple of minutes
# Steps (logged under $OUT/work, each under its own timeout and never past DEADLINE, 540 s), most important
# first; every bench is `jaxserve bench latency --precompile false` (only the shapes a run uses compile, on
# first use) in its own process, its report in $OUT/work/NAME.json:
#   bf16_b1, fp8w_b1      (a) batch 1, 128 in / 128 out, bf16 weights then --quantization fp8
#   bf16_b64, fp8w_b64    (b) batch 64, 128 in / 128 out, the same pair
#   kvbf16_ctx8k, kvfp8_ctx8k   (c) batch 64, 8000 in / 192 out (mean context ~8100), bf16 KV then
#               --kv-cache-dtype fp8, bf16 weights, max_model_len 8192 (the checkpoint's limit). Memory: the
#               K/V of a token is 32 layers x 2 x 8 kv heads x 128 x 2 bytes = 128 KiB in bf16, so 64 x 8192
#               tokens hold 64 GiB (32 GiB in fp8) beside 16 GB of weights: it fits the KV pool (0.85 of the
#               ~124 GB left after the weights, ~105 GB) with room to spare. One timed iteration, no warm-up:
#               the prefill (64 x 8000 tokens, one prompt per step) dominates its time; prompt i finishes at
#               about step i, so with 192 out the steps from ~65 to ~192 are pure decode at batch 64, and
#               the steady decode rate (median pure-decode step) is compile-free without a warm-up
#   ttft_32k    (e) configs/llama3.1-8b-dummy.yaml, one 32768-token prompt, 2 output tokens, 1 warm-up and 3
#               timed iterations (TTFT p50), the flash prefill off (every row on the ragged kernel)
#   bf16_b1_exact, fp8w_b1_exact   (a, d) bf16_b1 and fp8w_b1 on the config with token rungs [1, 4, 16, ...]
#               (weights mode, last)
#   tight_b1    (d) benchmarks/tight_loop_decode.py at batch 1 from context 128, 128 steps (mean context 192,
#               bf16_b1's), its roofline share beside the engine's
#   prefill_rates  benchmarks/prefill_rates.py: the matmul rate of a 8192-row chunk's GEMMs and the flash
#               kernel's rate over a 32K prompt's chunks, each alone: the rates of (e)'s compute bound
#   ttft_128k   one 131000-token prompt (reported, no target), if time is left
#   ttft_32k_flash, ttft_128k_flash   the same with --flash-prefill-token-threshold 4096, the GPU default (a
#               chunk's attention through the flash kernel over its prefix gathered from the cache); `long` runs these first,
#               after the flash kernels' GPU tests
#   tput_bf16, tput_fp8   (f) offline throughput, `jaxserve bench throughput` of 1000 prompts of 1024 in / 256
#               out (--precompile true: elapsed_s excludes compiling), bf16 then --quantization fp8 (decode
#               steps on the W8A8 Mosaic GPU kernel over weights held [N, K], prefill steps W8A8 through XLA on cuBLASLt)
# Modes: all (every step, in the order above; a step that does not fit is skipped and named "not run"),
# weights (a, b, d), long (the flash GPU tests, e), kv (c), throughput (f) and throughput_fp8 (f's fp8 run alone, with
# all the call's time): for separate calls when one did not finish; throughput_tuned: tput_bf16, then tput_bf16_512
# (the same on a config of 512 sequences and 16384 tokens per step); fp8_prefill: benchmarks/prefill_rates.py
# --fp8 (the W8A8 GEMMs of an 8192-row step at the engine's compile options, with cuBLASLt's algorithms timed,
# and on XLA's autotuned Triton GEMMs, with compile times) and the TTFT of one 8000-token prompt, bf16 then fp8
# weights (ttft_8k_bf16, ttft_8k_fp8); kernel: the
# FP8 decode GEMMs' GPU tests (the W8A8 Mosaic GPU kernel, quant.linear over weights held [N, K]) and
# benchmarks/fp8_gemm_mgpu.py (that kernel against XLA's bf16 dot and the Triton kernel), then
# benchmarks/fp8_gemm.py (the weight-only Triton kernel, a tensor-parallel engine's, against XLA's bf16 dot and
# its dequantizing fp8 dot at the 8B weight shapes, rows 1/16/64, over a small sweep of the kernel's tuning;
# its lines are printed as it runs). Then the table
# (benchmarks/fp8_summary.py) to stdout and $OUT/summary.txt, $OUT/summary.json, and every log and report in
# $OUT/fp8_logs.tar.gz.
set -o pipefail
OUT=${OUT:-/tmp/devrun_fp8}
DEADLINE=${DEADLINE:-540}
source benchmarks/devrun_common.sh
SHOW="^fp8 |^Decode:|^steady decode|^TTFT|^roofline|^compiled|^Throughput|^ +(xla|triton|mosaic)|^[a-z_]+ +K |passed|failed|^ *blkh |^[a-z_]+ +rows "
if [ -n "${SMOKE:-}" ]; then
  CFG="" LONG_CFG=""  # the default config: the embedded model
  B1="--input-len 4 --output-len 16" B64="--batch-size 8 --input-len 4 --output-len 12"
  KV="--batch-size 8 --input-len 16 --output-len 8" T32K="--input-len 24" T128K="--input-len 28" FLASH_MIN=8
  TIGHT="--config-json jaxserve/assets/tiny-adder/config.json --context 4 --steps 8"
  KERNEL="--smoke --rows 1" RATES="--smoke" T8K="--input-len 24"
else
  KERNEL="--rows 1,16,64" RATES="--chunk 8192 --prompt 32768"
  CFG="--config configs/llama3-8b-dummy.yaml" LONG_CFG="--config configs/llama3.1-8b-dummy.yaml"
  B1="--input-len 128 --output-len 128" B64="--batch-size 64 --input-len 128 --output-len 128"
  KV="--max-model-len 8192 --batch-size 64 --input-len 8000 --output-len 192" T32K="--input-len 32768"
  T128K="--input-len 131000" FLASH_MIN=4096 T8K="--max-model-len 8192 --input-len 8000"
  TIGHT="--config-json configs/models/llama3-8b/config.json --context 128 --steps 128"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.total --format=csv,noheader
fi
BENCH="$PY -m jaxserve.cli bench latency --disable-tqdm --precompile false"
# bench NAME MAX_S RESERVE_S ARGS...: one bench process (run), its report in $W/NAME.json
bench() {
  local name=$1 max=$2 reserve=$3; shift 3
  run "$name" "$max" "$reserve" $BENCH "$@" --output-json "$W/$name.json"
}
ITERS="--num-iters-warmup 1 --num-iters 2"
# Each step: MAX_S RESERVE_S (the reserve keeps time for the steps after it in the mode's order).
bf16_b1() { bench bf16_b1 "$1" "$2" $CFG --batch-size 1 $B1 $ITERS; }
fp8w_b1() { bench fp8w_b1 "$1" "$2" $CFG --batch-size 1 $B1 $ITERS --quantization fp8; }
# bf16_b1 and fp8w_b1 on a config whose token rungs start with the request rungs (1, 4), so a batch-1 decode
# step runs its matmuls on 1 row instead of the 16 of the smallest token rung. Written from the config into $W.
exact_rungs() {
  local file=$W/exact_rungs.yaml
  if [ -n "${SMOKE:-}" ]; then
    sed -e "s|token_buckets: \[|token_buckets: [1, |" jaxserve/configs/tiny.yaml > "$file"
  else
    sed -e "s|path: models/llama3-8b|path: $PWD/configs/models/llama3-8b|" \
        -e "s|token_buckets: \[16,|token_buckets: [1, 4, 16,|" configs/llama3-8b-dummy.yaml > "$file"
  fi
  echo "$file"
}
bf16_b1_exact() { bench bf16_b1_exact "$1" "$2" --config "$(exact_rungs)" --batch-size 1 $B1 $ITERS; }
fp8w_b1_exact() { bench fp8w_b1_exact "$1" "$2" --config "$(exact_rungs)" --batch-size 1 $B1 $ITERS --quantization fp8; }
bf16_b64() { bench bf16_b64 "$1" "$2" $CFG $B64 $ITERS; }
fp8w_b64() { bench fp8w_b64 "$1" "$2" $CFG $B64 $ITERS --quantization fp8; }
kvbf16_ctx8k() { bench kvbf16_ctx8k "$1" "$2" $CFG $KV --num-iters-warmup 0 --num-iters 1; }
kvfp8_ctx8k() { bench kvfp8_ctx8k "$1" "$2" $CFG $KV --num-iters-warmup 0 --num-iters 1 --kv-cache-dtype fp8; }
LONG="$LONG_CFG --batch-size 1 --output-len 2 --num-iters-warmup 1"
RAGGED="--flash-prefill-token-threshold 0"
ttft_32k() { bench ttft_32k "$1" "$2" $LONG $T32K --num-iters 3 $RAGGED; }
ttft_128k() { bench ttft_128k "$1" "$2" $LONG $T128K --num-iters 1 $RAGGED; }
FLASH="--flash-prefill-token-threshold $FLASH_MIN"
ttft_32k_flash() { bench ttft_32k_flash "$1" "$2" $LONG $T32K --num-iters 3 $FLASH; }
ttft_128k_flash() { bench ttft_128k_flash "$1" "$2" $LONG $T128K --num-iters 1 $FLASH; }
fp8_gemm() { run fp8_gemm "$1" "$2" $PY benchmarks/fp8_gemm.py $KERNEL --json "$W/fp8_gemm.json"; }
fp8_mgpu() { run fp8_mgpu "$1" "$2" $PY benchmarks/fp8_gemm_mgpu.py $KERNEL --json "$W/fp8_gemm_mgpu.json"; }
TPUT="$PY -m jaxserve.cli bench throughput $CFG --num-prompts 1000 --input-len 1024 --output-len 256 --disable-tqdm \
  --precompile true"
[ -z "${SMOKE:-}" ] || TPUT="$PY -m jaxserve.cli bench throughput --num-prompts 16 --input-len 4 --output-len 8 \
  --disable-tqdm --precompile false"
tput_bf16() { run tput_bf16 "$1" "$2" $TPUT --output-json "$W/tput_bf16.json"; }
# The same bench on a config with vLLM's offline batch limits for H100-class GPUs (max_num_seqs 512 here, the
# most whose 1024 + 256-token requests fit the KV pool, and max_num_batched_tokens 16384): decode steps of
# twice the rows, prefill steps of twice the tokens. Written from configs/llama3-8b-dummy.yaml into $W.
tput_bf16_512() {
  local file=$W/offline512.yaml
  sed -e "s|path: models/llama3-8b|path: $PWD/configs/models/llama3-8b|" -e "s|max_num_seqs: 256|max_num_seqs: 512|" \
      -e "s|max_num_batched_tokens: 8192|max_num_batched_tokens: 16384|" \
      -e "s|token_buckets: \[.*\]|token_buckets: [16, 64, 256, 512, 1024, 4096, 8192, 16384]|" \
      -e "s|request_buckets: \[.*\]|request_buckets: [1, 4, 16, 64, 256, 512]|" configs/llama3-8b-dummy.yaml > "$file"
  run tput_bf16_512 "$1" "$2" ${TPUT/$CFG/--config $file} --output-json "$W/tput_bf16_512.json"
}
tput_fp8() { run tput_fp8 "$1" "$2" $TPUT --quantization fp8 --output-json "$W/tput_fp8.json"; }
prefill_rates() { run prefill_rates "$1" "$2" $PY benchmarks/prefill_rates.py $RATES --json "$W/prefill_rates.json"; }
fp8_rates() { run fp8_rates "$1" "$2" $PY benchmarks/prefill_rates.py $RATES --fp8 --json "$W/fp8_rates.json"; }
PROMPT8K="$CFG --batch-size 1 --output-len 2 --num-iters-warmup 1 --num-iters 3 $T8K"
ttft_8k_bf16() { bench ttft_8k_bf16 "$1" "$2" $PROMPT8K; }
ttft_8k_fp8() { bench ttft_8k_fp8 "$1" "$2" $PROMPT8K --quantization fp8; }
tight_b1() {
  run tight_b1 "$1" "$2" $PY benchmarks/tight_loop_decode.py $TIGHT --batch-sizes 1 --output-json "$W/tight_b1.json"
}

MODE=${1:-all}
case "$MODE" in
all)
  bf16_b1 120 390; fp8w_b1 120 300; bf16_b64 90 240; fp8w_b64 90 180
  kvbf16_ctx8k 150 100; kvfp8_ctx8k 150 20; prefill_rates 60 10; ttft_32k_flash 120 10; ttft_32k 120 10; tight_b1 90 5
  ttft_128k_flash 150 5; ttft_128k 150 5
  tput_bf16 200 5; tput_fp8 200 5
  ;;
throughput)
  tput_bf16 260 250; tput_fp8 260 5
  ;;
throughput_fp8)  # fp8 alone: its start-up compile has taken more than 330 s on a fresh machine
  tput_fp8 530 5
  ;;
throughput_tuned)  # bf16 at today's batch limits, then at 512 sequences / 16384 tokens
  tput_bf16 260 250; tput_bf16_512 260 5
  ;;
fp8_prefill)  # FP8 weights on prefill-sized steps: the W8A8 GEMMs alone, then one 8000-token prompt's TTFT
  fp8_rates 260 240; ttft_8k_bf16 80 110; ttft_8k_fp8 100 5
  ;;
weights)
  bf16_b1 120 300; fp8w_b1 120 220; bf16_b64 90 170; fp8w_b64 90 110; tight_b1 90 70; bf16_b1_exact 90 40
  fp8w_b1_exact 90 5
  ;;
long)
  run flash_gpu_tests 120 420 $PY -m pytest -q -m gpu tests/test_flash_attention.py tests/test_flash_prefill.py \
    -p no:cacheprovider
  prefill_rates 60 360; ttft_32k_flash 110 250; ttft_32k 110 140; ttft_128k_flash 120 5; ttft_128k 150 5
  ;;
kv)
  kvbf16_ctx8k 160 160; kvfp8_ctx8k 160 5
  ;;
kernel)
  run fp8_mgpu_tests 120 300 $PY -m pytest -q -m gpu tests/test_fp8_gemm_mosaic.py tests/test_fp8_gemm.py
  fp8_mgpu 200 200
  fp8_gemm 200 5
  ;;
*)
  echo "unknown mode ${MODE}: all, weights, long, kv, throughput, throughput_fp8, throughput_tuned, fp8_prefill or" \
    "kernel"; exit 2
  ;;
esac
echo "== ${SECONDS}s: done"
tar -czf "$OUT/fp8_logs.tar.gz" -C "$OUT" work
$PY benchmarks/fp8_summary.py "$W" --json "$OUT/summary.json" | tee "$OUT/summary.txt"
rm -rf "$W"
