#!/usr/bin/env bash
# Device call: all GPU tests, then decode_step through paged_decode. Results under $OUT.
set -u
export PYTHONUNBUFFERED=1
python -m pip install -q --no-index --no-deps --upgrade --target /tmp/sf dist/*.whl
export PYTHONPATH=/tmp/sf
timeout 150 python -P -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc=$?" >> $OUT/gpu_tests.log
tail -n 3 $OUT/gpu_tests.log
(cd benchmarks && timeout 330 python decode_step.py --json $OUT/decode_step_paged.json > $OUT/decode_step_paged.log 2>&1)
grep -E "^ *[0-9]+ +[0-9]+ \|" $OUT/decode_step_paged.log
