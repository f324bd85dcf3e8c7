#!/usr/bin/env bash
# Device call E (right after D, while the machine is warm): install FA4 from the two wheel halves, then the FA4
# adapter test and decode_step through the FA4 adapter. Results under $OUT.
set -u
export PYTHONUNBUFFERED=1
cat /root/w/cu12.part.aa .whl2/cu12.part.ab > /root/nvidia_cutlass_dsl_libs_cu12-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
python -m pip install -q --no-index --no-deps --upgrade --target /tmp/site /root/*.whl .whl2/*.whl > $OUT/fa4_install.log 2>&1
python -m pip install -q --no-index --no-deps --upgrade --target /tmp/sf dist/*.whl
printf 'import site\nsite.addsitedir("/tmp/site")\n' > /tmp/sf/sitecustomize.py
export PYTHONPATH=/tmp/sf
timeout 120 python -P -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k fa4 > $OUT/fa4_test.log 2>&1
echo "fa4 test rc=$?" >> $OUT/fa4_test.log
tail -n 3 $OUT/fa4_test.log
(cd benchmarks && timeout 190 python decode_step.py --attention fa4 --json $OUT/decode_step_fa4.json > $OUT/decode_step_fa4.log 2>&1)
grep -v "^W11\|^  \|^/" $OUT/decode_step_fa4.log | tail -n 12
