#!/usr/bin/env bash
# One script for the H200 device runs, by stage; results under $OUT.
#
#   bash benchmarks/run_h200.sh tests   # GPU tests (-m gpu; the 2-GPU one skips on one GPU); stashes the first FA4
#                                       # wheel half (.whl/) in /root/w
#   bash benchmarks/run_h200.sh fa4     # right after `tests` (the machine stays warm ~30 s): joins the halves
#                                       # (.whl2/), installs FA4, runs its test and decode_step through FA4
#   bash benchmarks/run_h200.sh bench ARGS...   # decode_step.py with ARGS (paged_decode)
#   bash benchmarks/run_h200.sh tp ARGS...      # on 2 GPUs (nvidia-h200-x2): the TP tests, decode_step_tp.py at TP=2
#                                               # with ARGS, and the TP=1 baseline at B=1, 32K
#
# Needs dist/*.whl (make wheel) carried in every call. FA4 wheels: see BENCHMARKS.md, "Reproduce".
set -u
export PYTHONUNBUFFERED=1
# NVLink multicast stays off on these machines (NCCL, PyTorch symmetric memory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
stage=${1:?stage: tests, fa4 or bench}
shift
python -m pip install -q --no-index --no-deps --upgrade --target /tmp/sf dist/*.whl
export PYTHONPATH=/tmp/sf
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt"
python -c "import torch, triton, sys; print(torch.__version__, triton.__version__, sys.version.split()[0])" >> "$OUT/gpu.txt"
case "$stage" in
  tests)
    mkdir -p /root/w && cp .whl/* /root/w/ 2>/dev/null
    timeout 430 python -P -m pytest -q -rs -s -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_tp.py \
      > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc=$?" >> "$OUT/gpu_tests.log"
    grep -E "passed|failed|rc=" "$OUT/gpu_tests.log" | tail -n 3
    ;;
  fa4)
    cat /root/w/cu12.part.aa .whl2/cu12.part.ab > /root/nvidia_cutlass_dsl_libs_cu12-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
    python -m pip install -q --no-index --no-deps --upgrade --target /tmp/site /root/*.whl .whl2/*.whl > "$OUT/fa4_install.log" 2>&1
    printf 'import site\nsite.addsitedir("/tmp/site")\n' > /tmp/sf/sitecustomize.py
    timeout 120 python -P -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k fa4 > "$OUT/fa4_test.log" 2>&1
    echo "fa4 test rc=$?" >> "$OUT/fa4_test.log"
    tail -n 2 "$OUT/fa4_test.log"
    (cd benchmarks && timeout 420 python decode_step.py --attention fa4 "$@" --json "$OUT/decode_step_fa4.json" \
      > "$OUT/decode_step_fa4.log" 2>&1)
    grep -v "^W1\|^  \|^/" "$OUT/decode_step_fa4.log" | tail -n 12
    ;;
  bench)
    (cd benchmarks && timeout 540 python decode_step.py "$@" --json "$OUT/decode_step.json" > "$OUT/decode_step.log" 2>&1)
    grep -v "^W1\|^  \|^/" "$OUT/decode_step.log" | tail -n 12
    ;;
  tp)
    timeout 200 python -P -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_tp.py > "$OUT/tp_tests.log" 2>&1
    echo "tp tests rc=$?" >> "$OUT/tp_tests.log"
    grep -E "passed|failed|rc=" "$OUT/tp_tests.log" | tail -n 2
    (cd benchmarks && timeout 330 torchrun --nproc-per-node 2 decode_step_tp.py "$@" --json "$OUT/decode_step_tp2.json" \
      > "$OUT/decode_step_tp2.log" 2>&1; echo "tp2 rc=$?" >> "$OUT/decode_step_tp2.log")
    grep -E "^TP=|rc=" "$OUT/decode_step_tp2.log"
    (cd benchmarks && timeout 120 torchrun --nproc-per-node 1 decode_step_tp.py --batches 1 --contexts 32768 \
      --json "$OUT/decode_step_tp1.json" > "$OUT/decode_step_tp1.log" 2>&1; echo "tp1 rc=$?" >> "$OUT/decode_step_tp1.log")
    grep -E "^TP=|rc=" "$OUT/decode_step_tp1.log"
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
