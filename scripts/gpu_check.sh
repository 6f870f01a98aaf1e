#!/usr/bin/env bash
# GPU runs, logs under $OUT. Each part fits in ten minutes:
#   bash scripts/gpu_check.sh tests [pytest args]   first build (timed, empty cache) + the test suite
#                                                   (e.g. -n 8 -x), then the KernelBench tests alone
#   bash scripts/gpu_check.sh stress                2,000 fuzz examples on the GPU + 8-process first use
#   bash scripts/gpu_check.sh bench [bench args]    python -m fusedloss bench, GPU clocks logged alongside
#   bash scripts/gpu_check.sh multi-gpu WHEEL       two or more GPUs, from the installed wheel: the cuda:1
#                                                   placement tests, DTensor on NCCL ranks, the tensor-parallel
#                                                   loop, DDP's 20 steps and the sharded step's time
set -uo pipefail
part=$1; shift
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
case $part in
  tests)
    export TORCH_EXTENSIONS_DIR=$(mktemp -d)
    {
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
      python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
      echo "== first build (empty cache), $(nproc) cores"
      /usr/bin/time -f "first build wall %e s" python3 -m fusedloss build
      echo "== second process (cached)"
      /usr/bin/time -f "cached process wall %e s" python3 -c "import time, torch; start = time.perf_counter(); \
from fusedloss import build; build.load(); print(f'cached load {time.perf_counter() - start:.3f} s after importing torch')"
      echo "== a failed build, then a second process"
      python3 scripts/failed_build_fallback.py
    } 2>&1 | tee "$OUT/build.log"
    cp "$TORCH_EXTENSIONS_DIR"/fusedloss_*/.ninja_log "$OUT/ninja_log.txt"  # per-file compile times
    # The KernelBench evaluations hold several 4 GiB tensors each: alone, after the rest.
    python3 -m pytest -q -p no:cacheprovider --ignore=tests/test_kernelbench.py "$@" 2>&1 | tee "$OUT/tests.log" | tail -60
    python3 -m pytest -q -p no:cacheprovider tests/test_kernelbench.py 2>&1 | tee "$OUT/kernelbench_tests.log" | tail -20
    grep -hE "^(FAILED|ERROR)" "$OUT/tests.log" "$OUT/kernelbench_tests.log" > "$OUT/failures.txt" || true
    ;;
  stress)
    python3 scripts/concurrent_first_use.py --processes 8 2>&1 | tee "$OUT/concurrent_first_use.log"
    # 500 examples per loss, 4 losses: 2,000 on the GPU
    FUSEDLOSS_FUZZ_EXAMPLES=${FUZZ_EXAMPLES:-500} python3 -m pytest -q -p no:cacheprovider tests/test_fuzz.py \
      -k cuda --hypothesis-show-statistics 2>&1 | tee "$OUT/fuzz_gpu.log" | grep -E "passed|failed|examples|error" | tail -30
    ;;
  multi-gpu)
    # NVLink multicast off (the device's notes say why); the tests import the installed wheel.
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    site=$(mktemp -d)
    python3 -m pip install -q --no-deps --no-compile --target "$site" "$1" || exit 1
    export PYTHONPATH=$site
    {
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
      python3 -c "import torch, fusedloss; print('torch', torch.__version__, 'fusedloss from', fusedloss.__file__)"
      python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_placement.py tests/test_sharding.py tests/test_ddp.py
      python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/sharded_step.py
    } 2>&1 | tee "$OUT/multi_gpu.log" | tail -40
    ;;
  bench)
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_event_reasons.active \
      --format=csv -lms 500 > "$OUT/gpu_clocks.csv" 2>&1 &
    smi=$!
    python3 -m fusedloss bench --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "it/s\]" | tail -70
    kill $smi
    ;;
esac
