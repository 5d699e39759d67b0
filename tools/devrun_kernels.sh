# Kernel checks and benchmarks on the device machine, in one call; logs under $OUT.
#   bash tools/devrun_kernels.sh [all|mixed-prefill]
#   all (default): GPU-tier kernel and engine tests, then the decode benchmark.
#   mixed-prefill: the flash-attention GPU tests (Triton, Mosaic GPU, the Hopper dispatch), the
#                  mixed-batch benchmark and the prefill benchmark (Triton default, Mosaic, peers).
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
git log --oneline -1 2>/dev/null || true
PYTEST="python3 -m pytest -q -m gpu -p no:cacheprovider -W ignore::DeprecationWarning"
case "${1:-all}" in
all)
  $PYTEST tests/test_paged_attention_gpu.py benchmarks/experimental/tests/test_flash_attention.py tests/test_engine_pallas.py 2>&1 | tee $OUT/gpu_tests.log | tail -25
  python3 benchmarks/attention.py --section decode 2>&1 | grep -v Warning | tee $OUT/decode.log | tail -12
  ;;
mixed-prefill)
  $PYTEST benchmarks/experimental/tests/test_flash_attention.py 2>&1 | tee $OUT/flash_tests.log | tail -15
  python3 benchmarks/attention.py --section mixed --json $OUT/mixed.json 2>&1 | grep -v Warning > $OUT/mixed.log
  python3 benchmarks/prefill_attention.py --no-sweep 2>&1 | grep -v Warning > $OUT/prefill.log
  tail -18 $OUT/prefill.log
  tail -8 $OUT/mixed.log
  ;;
esac
