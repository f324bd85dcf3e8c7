#!/usr/bin/env bash
# Device call A: GPU tests, kernel benchmarks, compute-sanitizer memcheck. Results under $OUT.
set -u
export PYTHONUNBUFFERED=1
mkdir -p /root/w && cp .whl/* /root/w/ 2>/dev/null
python -m pip install -q --no-index --no-deps --target /tmp/sf dist/*.whl
export PYTHONPATH=/tmp/sf
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc=$?" >> $OUT/gpu_tests.log
(cd benchmarks && timeout 150 python page_table.py --json $OUT/page_table.json > $OUT/page_table.log 2>&1)
(cd benchmarks && timeout 150 python paged_decode.py --json $OUT/paged_decode.json > $OUT/paged_decode.log 2>&1)
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
  -k "test_page_table_cuda_sentinel or (test_paged_decode_cuda_against_float64 and bfloat16)" > $OUT/memcheck.log 2>&1
echo "memcheck rc=$?" >> $OUT/memcheck.log
tail -3 $OUT/gpu_tests.log $OUT/memcheck.log; cat $OUT/page_table.log $OUT/paged_decode.log
