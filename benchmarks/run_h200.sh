#!/usr/bin/env bash
# The one script for the GPU machine's runs: every stage named on the command line runs, in order, each under
# its own time limit; logs and JSON go to $OUT (the device tool brings them back), a stage's failure does not
# stop the next.
#
#   bash benchmarks/run_h200.sh STAGE [STAGE ...]
#
#   tune       benchmarks/tune.py: the paged_decode launch sweep at small batch, against the kernel of
#              $OLD_KERNEL (default oldk/old_paged_decode_kernel.py, `git show 0d72b29:kernels/paged_decode_kernel.py`)
#              when present; the best configuration goes to /root/tuning.json
#   tests      the GPU tests (pytest -m gpu tests/test_gpu.py tests/kernels/test_page_table_gpu.py tests/test_tp.py; the
#              2-GPU test skips on one GPU); TESTS_LIMIT defaults to 540 s (195-444 s measured, 2026-12-02/04)
#   memcheck   compute-sanitizer --tool memcheck on benchmarks/memcheck_page_table.py (the page-table ops on
#              strided, expanded, negative, out-of-range and past-bound inputs) and memcheck_paged_decode.py
#              (paged_decode's paths, ragged_extend_attention, kv_indices), with the caching allocator off
#              so that a read past a tensor is an error memcheck sees; prints the ERROR SUMMARY line
#   loop       benchmarks/decode_loop.py $LOOP_ARGS (the 8B-shaped generation loop)
#   short      benchmarks/paged_decode.py --compare --sweep-short: the short-context path against the split path
#   round-up   benchmarks/engine_steps_gpu.py --residue-sweep at max_context_len $ROUND_UP_BOUND (default 32768):
#              TRTLLM-MLA's round-up and FlashMLA's scratch, maxima at the edges of every residue class (issue 45)
#   engine-steps  benchmarks/engine_steps_gpu.py ($ENGINE_ARGS): issue 20's MLA-style, indptr, flat kv_indices and regional steps and issue 30's
#              FlashMLA-shaped (grown scratch) and TRTLLM-MLA-shaped (round-up width) steps,
#              cudagraphs=True, replayed under sync debug "error", equal to eager, partitions counted
#   pagetable-tests  pytest -m gpu tests/kernels/test_page_table_gpu.py (the page-table op against eager indexing on CUDA)
#   kernels    benchmarks/page_table.py and benchmarks/paged_decode.py (FA4 columns when FA4 is installed)
#   steps      benchmarks/decode_step.py $STEP_ARGS (the 2-layer decoder; $STEP_ATTENTION paged_decode or fa4)
#   tp         on 2 GPUs: the TP tests, decode_step_tp.py at TP=2 ($TP_ARGS) and the TP=1 baseline
#   fa4-stash  keep the first half of FA4's wheels (.whl/, carried) in /root/w for the next call
#   fa4        join the halves (.whl2/, carried now), install FA4 into /tmp/site and run its GPU test
#   sglang-fa3 SGLang 0.5.23's own FA3 decode path compiled through the backend (benchmarks/sglang_fa3_gpu.py):
#              installs the wheels of .whl-sglang/ (carried: sglang and the small packages the H200 image
#              lacks, see tests/sglang/README-gpu.md) into /tmp/sgl and runs the script with tests/sglang (the
#              harness and the sgl_kernel stand-ins) on PYTHONPATH; $SGL_ARGS go to the script
#   compile-time  benchmarks/compile_time.py: where the 8B-shaped loop's cold first call goes (issue 22); each
#              variant (syncfree / stock, regional / whole) cold and warm in fresh processes, then knob runs while
#              the budget ($CT_LIMIT - 20 s) lasts; $CT_ARGS replaces the default knob list (and may add flags)
#   startup    benchmarks/compile_time.py for issue 29: the variants of $STARTUP_VARIANTS (default all four:
#              "syncfree-regional syncfree-whole stock-whole stock-regional"), each cold (empty caches), warm (a
#              second process on the same caches) and shipped (a third process on new empty caches that first
#              loads the artifacts the cold run saved with compile_pass.cache); the syncfree ones also precompiled
#              (the step the cold run saved with aot_compile, all caches new and empty: its Triton binaries come
#              from the file) and precompiled kept-triton (the same step on the cold run's Triton cache, new
#              empty Inductor cache), with the breakdown and kernel counts; then knob runs (levers) while the
#              budget ($STARTUP_LIMIT - 20 s) lasts; $STARTUP_ARGS replaces the default knob list (and may add
#              flags: "--no-warm --knobs" for no warm reruns and no knobs). Fits one device call: STARTUP_LIMIT
#              defaults to 500 s. A short call for the precompiled starts alone:
#              STARTUP_VARIANTS=syncfree-regional STARTUP_ARGS="--no-warm --knobs" STARTUP_LIMIT=360
#              Every variant uses a KV tensor per layer (the knob stacked-kv: one stacked pool; outline-repeats:
#              the backend option outline_repeats=True for syncfree-whole); the
#              stock-static-* variants are stock torch.compile of the hand-written sync-free step (decode_loop's f)
#              ($STARTUP_NAME names its log and JSON, default startup)
#   startup2   a second startup run in the same call ($STARTUP2_VARIANTS, default syncfree-regional;
#              $STARTUP2_ARGS; STARTUP2_LIMIT default 300 s): startup2.log / startup2.json
#   host       benchmarks/host_overhead.py $HOST_ARGS (issue 43): host time per call of compile_pass.compile's step
#              (cudagraphs=True) against stock reduce-overhead of the hand-written step and a raw CUDAGraph.replay(),
#              1/4/32 layers x batch 1/8, interleaved rounds; HOST_ARGS="--profile 200" adds a cProfile of ours per
#              configuration; HOST_LIMIT defaults to 540 s
#   profile    the same script with --profile: the cold first calls of $PROFILE_VARIANTS (default
#              "syncfree-regional syncfree-whole") under cProfile, one $OUT/profile/<run>.pstats each (their
#              seconds are slowed by the profiler: not for the tables); $PROFILE_ARGS adds flags;
#              PROFILE_LIMIT defaults to 300 s
#
# With TUNED=1 the benchmarks run with $TUNING_FILE (default /root/tuning.json, written by `tune` in an earlier
# call on the same machine) in place of the committed TUNING. Needs dist/*.whl (make wheel) carried in every call;
# dist/COMMIT names the commit the wheel was built from.
set -u
export PYTHONUNBUFFERED=1
# NVLink multicast stays off on these machines (NCCL, PyTorch symmetric memory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ $# -gt 0 ] || { echo "usage: run_h200.sh STAGE [STAGE ...]" >&2; exit 2; }
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python -m pip install -q --no-index --no-deps --upgrade --target /tmp/sf dist/*.whl
export PYTHONPATH=/tmp/sf${PYTHONPATH:+:$PYTHONPATH}
export SYNCFREE_COMMIT=$(cat dist/COMMIT 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt"
python -c "import torch, triton, sys; print(torch.__version__, triton.__version__, sys.version.split()[0])" >> "$OUT/gpu.txt"
echo "commit $SYNCFREE_COMMIT" >> "$OUT/gpu.txt"
TUNING_ARG=()
if [ "${TUNED:-0}" = 1 ]; then
  TUNING_FILE=${TUNING_FILE:-/root/tuning.json}
  case "$TUNING_FILE" in /*) ;; *) TUNING_FILE=$PWD/$TUNING_FILE ;; esac
  TUNING_ARG=(--tuning "$TUNING_FILE")
  echo "paged_decode TUNING from $TUNING_FILE: $(cat "$TUNING_FILE")"
fi

bench() {  # bench LIMIT NAME python-args...: run one benchmark in benchmarks/, log to $OUT/NAME.log
  local limit=$1 name=$2
  shift 2
  (cd benchmarks && timeout "$limit" python "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" >> "$OUT/$name.log")
  grep -v "^W1\|^  \|^/\|Warning\|warn(" "$OUT/$name.log" | tail -n "${TAIL:-14}"
}

for stage in "$@"; do
  echo "== $stage ($(date +%T))"
  case "$stage" in
    tune)
      old=${OLD_KERNEL:-oldk/old_paged_decode_kernel.py}
      args=(tune.py --only paged_decode --write-best /root/tuning.json --json "$OUT/tune.json")
      [ -f "$old" ] && args+=(--old-kernel "$PWD/$old")
      mkdir -p /root
      TAIL=40 bench "${TUNE_LIMIT:-420}" tune "${args[@]}"
      cp /root/tuning.json "$OUT/tuning.json" 2>/dev/null
      ;;
    tests)
      timeout "${TESTS_LIMIT:-540}" python -P -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_gpu.py \
        tests/kernels/test_page_table_gpu.py tests/test_tp.py > "$OUT/gpu_tests.log" 2>&1
      echo "gpu tests rc=$?" >> "$OUT/gpu_tests.log"
      grep -E "passed|failed|rc=|^FAILED|^ERROR" "$OUT/gpu_tests.log" | tail -n 8
      ;;
    memcheck)
      sanitizer=$(command -v compute-sanitizer || find /usr/local /opt "$(python -c 'import site; print(site.getsitepackages()[0])')" \
        -name compute-sanitizer -type f -perm -u+x 2>/dev/null | head -n 1)
      if [ -z "$sanitizer" ]; then
        echo "memcheck: compute-sanitizer not found" | tee "$OUT/memcheck.log"
      else
        : > "$OUT/memcheck.log"
        for script in ${MEMCHECK_SCRIPTS:-memcheck_page_table.py memcheck_paged_decode.py}; do
          echo "== $script" >> "$OUT/memcheck.log"
          (cd benchmarks && PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${MEMCHECK_LIMIT:-420}" "$sanitizer" --tool memcheck \
            python "$script" >> "$OUT/memcheck.log" 2>&1; echo "memcheck $script rc=$?" >> "$OUT/memcheck.log")
        done
        grep -E "^== |ERROR SUMMARY|^memcheck_page|^DIFFERS|rc=" "$OUT/memcheck.log" | tail -n 12
      fi
      ;;
    loop)
      # shellcheck disable=SC2086
      TAIL=30 bench "${LOOP_LIMIT:-540}" decode_loop decode_loop.py ${LOOP_ARGS:-} "${TUNING_ARG[@]}" \
        --json "$OUT/decode_loop.json"
      ;;
    short)
      # paged_decode's short-context path against the split path (and a launch sweep of it): table + JSON
      TAIL=45 bench "${SHORT_LIMIT:-330}" paged_decode_short paged_decode.py --compare --sweep-short \
        --json "$OUT/paged_decode_short.json"
      ;;
    engine-steps)
      # issue 20's MLA-style, indptr, flat kv_indices and regional steps, issue 30's flashmla_scratch and
      # trtllm_round_up, under cudagraphs (engine_steps_gpu.py)
      # shellcheck disable=SC2086
      TAIL=12 bench "${ENGINE_LIMIT:-240}" engine_steps engine_steps_gpu.py ${ENGINE_ARGS:-} --json "$OUT/engine_steps.json"
      ;;
    round-up)
      # issue 45: TRTLLM-MLA's round-up at max_context_len $ROUND_UP_BOUND (default 32768), maxima at the edges of
      # every residue class of the round-up, cudagraphs, replayed under sync debug "error": equal to eager, no device
      # assert, one partition per batch size; then FlashMLA's grown scratch at the same bound
      # shellcheck disable=SC2086
      TAIL=12 bench "${ROUND_UP_LIMIT:-300}" round_up engine_steps_gpu.py --steps trtllm_round_up flashmla_scratch \
        --max-context-len "${ROUND_UP_BOUND:-32768}" --residue-sweep --batches "${ROUND_UP_BATCHES:-4,1}" \
        --json "$OUT/round_up.json"
      ;;
    pagetable-tests)
      timeout "${PT_TESTS_LIMIT:-150}" python -P -m pytest -q -rs -p no:cacheprovider -m gpu tests/kernels/test_page_table_gpu.py \
        > "$OUT/gpu_page_table_tests.log" 2>&1
      echo "page-table gpu tests rc=$?" >> "$OUT/gpu_page_table_tests.log"
      grep -E "passed|failed|rc=|^FAILED|^ERROR" "$OUT/gpu_page_table_tests.log" | tail -n 8
      ;;
    kernels)
      bench "${TABLE_LIMIT:-90}" page_table page_table.py --json "$OUT/page_table.json"
      TAIL=30 bench "${DECODE_LIMIT:-240}" paged_decode paged_decode.py "${TUNING_ARG[@]}" --json "$OUT/paged_decode.json"
      ;;
    steps)
      # shellcheck disable=SC2086
      bench "${STEPS_LIMIT:-300}" "decode_step_${STEP_ATTENTION:-paged_decode}" decode_step.py \
        --attention "${STEP_ATTENTION:-paged_decode}" ${STEP_ARGS:-} "${TUNING_ARG[@]}" \
        --json "$OUT/decode_step_${STEP_ATTENTION:-paged_decode}.json"
      ;;
    tp)
      timeout 200 python -P -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_tp.py > "$OUT/tp_tests.log" 2>&1
      echo "tp tests rc=$?" >> "$OUT/tp_tests.log"
      grep -E "passed|failed|rc=" "$OUT/tp_tests.log" | tail -n 2
      # shellcheck disable=SC2086
      (cd benchmarks && timeout 330 torchrun --nproc-per-node 2 decode_step_tp.py ${TP_ARGS:-} \
        --json "$OUT/decode_step_tp2.json" > "$OUT/decode_step_tp2.log" 2>&1; echo "tp2 rc=$?" >> "$OUT/decode_step_tp2.log")
      grep -E "^TP=|rc=" "$OUT/decode_step_tp2.log"
      (cd benchmarks && timeout 120 torchrun --nproc-per-node 1 decode_step_tp.py --batches 1 --contexts 32768 \
        --json "$OUT/decode_step_tp1.json" > "$OUT/decode_step_tp1.log" 2>&1; echo "tp1 rc=$?" >> "$OUT/decode_step_tp1.log")
      grep -E "^TP=|rc=" "$OUT/decode_step_tp1.log"
      ;;
    fa4-stash)
      mkdir -p /root/w && cp .whl/* /root/w/ && ls /root/w
      ;;
    fa4)
      cat /root/w/cu12.part.aa .whl2/cu12.part.ab \
        > /root/nvidia_cutlass_dsl_libs_cu12-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
      python -m pip install -q --no-index --no-deps --upgrade --target /tmp/site /root/*.whl .whl2/*.whl \
        > "$OUT/fa4_install.log" 2>&1
      printf 'import site\nsite.addsitedir("/tmp/site")\n' > /tmp/sf/sitecustomize.py
      timeout 120 python -P -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k fa4 > "$OUT/fa4_test.log" 2>&1
      echo "fa4 test rc=$?" >> "$OUT/fa4_test.log"
      tail -n 2 "$OUT/fa4_test.log"
      ;;
    sglang-fa3)
      python -m pip install -q --no-index --no-deps --no-compile --target /tmp/sgl .whl-sglang/*.whl \
        > "$OUT/sglang_install.log" 2>&1 || { echo "sglang-fa3: install failed"; tail -n 5 "$OUT/sglang_install.log"; }
      # shellcheck disable=SC2086
      PYTHONPATH=/tmp/sf:/tmp/sgl:$PWD/tests/sglang TAIL=30 bench "${SGL_LIMIT:-420}" sglang_fa3_gpu sglang_fa3_gpu.py \
        ${SGL_ARGS:-} --json "$OUT/sglang_fa3_gpu.json"
      ;;
    compile-time)
      ct_limit=${CT_LIMIT:-350}
      # shellcheck disable=SC2086
      TAIL=60 bench "$ct_limit" compile_time compile_time.py --budget $((ct_limit - 20)) \
        ${CT_ARGS:---knobs threads1 prewarm-pool no-cudagraph-trees no-pointwise-autotune} --json "$OUT/compile_time.json"
      ;;
    startup)
      st_limit=${STARTUP_LIMIT:-500}
      # shellcheck disable=SC2086
      TAIL=80 bench "$st_limit" "${STARTUP_NAME:-startup}" compile_time.py --budget $((st_limit - 20)) --timeout 200 \
        --variants ${STARTUP_VARIANTS:-syncfree-regional syncfree-whole stock-whole stock-regional} \
        ${STARTUP_ARGS:---knobs no-cudagraph-trees no-checked prewarm-pool no-pointwise-autotune} \
        --json "$OUT/${STARTUP_NAME:-startup}.json"
      ;;
    startup2)  # a second startup run in the same call: $STARTUP2_VARIANTS / $STARTUP2_ARGS / $STARTUP2_LIMIT
      st2_limit=${STARTUP2_LIMIT:-300}
      # shellcheck disable=SC2086
      TAIL=80 bench "$st2_limit" startup2 compile_time.py --budget $((st2_limit - 20)) --timeout 200 \
        --variants ${STARTUP2_VARIANTS:-syncfree-regional} ${STARTUP2_ARGS:-} --json "$OUT/startup2.json"
      ;;
    host)
      # shellcheck disable=SC2086
      TAIL=${HOST_TAIL:-20} bench "${HOST_LIMIT:-540}" host_overhead host_overhead.py ${HOST_ARGS:-} \
        --out "$OUT/host_overhead.json"
      ;;
    profile)
      pr_limit=${PROFILE_LIMIT:-300}
      # shellcheck disable=SC2086
      TAIL=60 bench "$pr_limit" profile compile_time.py --budget $((pr_limit - 20)) --timeout 200 --no-warm \
        --no-shipped --knobs --profile "$OUT/profile" --variants ${PROFILE_VARIANTS:-syncfree-regional syncfree-whole} \
        ${PROFILE_ARGS:-} --json "$OUT/profile.json"
      ;;
    *) echo "unknown stage $stage" >&2 ;;
  esac
done
echo "== done ($(date +%T))"
