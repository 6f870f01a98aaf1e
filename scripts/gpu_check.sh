#!/usr/bin/env bash
# Device runs, logs under $OUT. Each part fits one 10-minute device call:
#   bash scripts/gpu_check.sh tests [pytest args]   first build (timed, empty cache) + the test suite
#   bash scripts/gpu_check.sh bench [bench args]    python -m fusedloss bench
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
      echo "== first build (empty cache)"
      /usr/bin/time -f "first build wall %e s" python3 -m fusedloss build
      echo "== second process (cached)"
      /usr/bin/time -f "cached load wall %e s" python3 -m fusedloss build
    } 2>&1 | tee "$OUT/build.log"
    python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/tests.log" | tail -60
    ;;
  bench)
    python3 -m fusedloss bench --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "it/s\]" | tail -70
    ;;
esac
