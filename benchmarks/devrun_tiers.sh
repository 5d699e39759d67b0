# KV cache tiers on an H200 (Llama-3-8B shape, random weights), one call under 9 minutes; the table is
# printed last.
#   bash benchmarks/devrun_tiers.sh                    on the device
#   SMOKE=1 PYTHON=/path/to/python bash benchmarks/devrun_tiers.sh    the same plumbing on a CPU: the embedded
#       model (jaxserve/assets/tiny-adder), tiny shapes, about a minute
# Steps (logged under $OUT/work, each under its own timeout and never past DEADLINE, 540 s), most important
# first:
#   kv_tiers    benchmarks/kv_tiers.py on configs/llama3-8b-dummy.yaml: device <-> host copies of 512 blocks
#               through kv_transfer beside plain pinned copies, then 128 two-turn conversations (1024-token
#               prompts, 64 out, 64 appended) on a device pool a third of the working set, host tier off then
#               on. Memory: a block is 16 tokens x 128 KiB = 2 MiB; the working set is 128 x 140 blocks = 35 GiB,
#               the device pool ~12 GiB, the host tier 1.1 x the working set, ~39 GiB of the host's 128 GiB
#               (the bench's default 256 conversations would pin ~77 GiB)
#   preempt_recompute, preempt_swap, preempt_auto    `jaxserve bench throughput`, 128 prompts of 1024 in / 256
#               out on kv_tiers' device pool of 5973 blocks (~12 GiB: 93 prompts fit, about 74 requests at full
#               length, so decode preempts) with a 16 GiB host tier, --preemption-mode each in turn;
#               --precompile true, so elapsed_s (queueing to the last finish) excludes compiling; with the pool
#               of the kv_tiers engines (the KV cache's shape is part of every step program) the shapes come
#               from the persistent cache
# Then the table (benchmarks/tiers_summary.py; it reads kv_tiers.log when a cut-short run wrote no JSON) to
# stdout and $OUT/summary.txt, $OUT/summary.json, and every log and report in $OUT/tiers_logs.tar.gz.
set -o pipefail
OUT=${OUT:-/tmp/devrun_tiers}
DEADLINE=${DEADLINE:-540}
source benchmarks/devrun_common.sh
SHOW="GB/s|^host_tier_o|^on / off|^Throughput|^KV cache|^compiled"
if [ -n "${SMOKE:-}" ]; then
  TIERS="--smoke"
  # 12 requests of 4 blocks (block size 4) on 12 blocks: three at a time, the rest preempted
  PRE="--num-prompts 12 --input-len 9 --output-len 6 --num-blocks 12 --host-kv-gib 0.001 --precompile false"
else
  TIERS="--config configs/llama3-8b-dummy.yaml --conversations 128 --prompt-len 1024 --output-len 64
    --append-len 64 --copy-blocks 512 --repeats 5"
  PRE="--config configs/llama3-8b-dummy.yaml --num-prompts 128 --input-len 1024 --output-len 256 --num-blocks 5973
    --host-kv-gib 16 --precompile true"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.total --format=csv,noheader
  free -g | head -2
fi
# preempt MODE MAX_S RESERVE_S: one throughput bench with --preemption-mode MODE
preempt() {
  run "preempt_$1" "$2" "$3" $PY -m jaxserve.cli bench throughput $PRE --preemption-mode "$1" --disable-tqdm \
    --output-json "$W/preempt_$1.json"
}

run kv_tiers 330 150 $PY benchmarks/kv_tiers.py $TIERS --output-json "$W/kv_tiers.json"
preempt recompute 100 90
preempt swap 90 45
preempt auto 90 5
echo "== ${SECONDS}s: done"
tar -czf "$OUT/tiers_logs.tar.gz" -C "$OUT" work
$PY benchmarks/tiers_summary.py "$W" --json "$OUT/summary.json" | tee "$OUT/summary.txt"
rm -rf "$W"
