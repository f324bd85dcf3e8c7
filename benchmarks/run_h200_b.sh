#!/usr/bin/env bash
# Device call: GPU tests, memcheck, tuning sweep, a decode_step trial. Results under $OUT.
set -u
export PYTHONUNBUFFERED=1
python -m pip install -q --no-index --no-deps --upgrade --target /tmp/sf dist/*.whl
export PYTHONPATH=/tmp/sf
[ -d /tmp/site ] && printf 'import site\nsite.addsitedir("/tmp/site")\n' > /tmp/sf/sitecustomize.py
timeout 240 python -P -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc=$?" >> $OUT/gpu_tests.log
timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 python -P -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
  -k "test_page_table_cuda_sentinel or (test_paged_decode_cuda_against_float64 and bfloat16)" > $OUT/memcheck.log 2>&1
echo "memcheck rc=$?" >> $OUT/memcheck.log
tail -n 4 $OUT/gpu_tests.log $OUT/memcheck.log
(cd benchmarks && timeout 240 python tune.py --json $OUT/tune.json > $OUT/tune.log 2>&1)
grep best $OUT/tune.log
(cd benchmarks && timeout 240 python decode_step.py --batches 1 --contexts 4096 --layers 1 --json $OUT/decode_trial.json > $OUT/decode_trial.log 2>&1)
tail -n 5 $OUT/decode_trial.log
