set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
git log --oneline -1 2>/dev/null || true
python3 -m pytest -q -m gpu -p no:cacheprovider -W ignore::DeprecationWarning tests/test_paged_attention_gpu.py tests/test_flash_attention.py tests/test_engine_pallas.py 2>&1 | tee $OUT/gpu_tests.log | tail -25
python3 benchmarks/attention.py --section decode 2>&1 | grep -v Warning | tee $OUT/decode.log | tail -12
