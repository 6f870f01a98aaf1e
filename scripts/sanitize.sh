#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck, initcheck and synccheck over every
# fusedloss kernel (scripts/sanitizer_cases.py). Needs a GPU machine where
# compute-sanitizer works (the Firecracker kinds). Logs under $OUT.
set -uo pipefail
OUT=${OUT:-sanitize-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
python3 -m fusedloss build  # build outside the sanitizer
status=0
for tool in memcheck racecheck initcheck synccheck; do
  SECONDS=0
  # No caching allocator, so an out-of-bounds access cannot land in a cached block.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${TOOL_TIMEOUT:-900}" compute-sanitizer --tool "$tool" --error-exitcode 1 \
    python3 scripts/sanitizer_cases.py >"$OUT/$tool.log" 2>&1
  rc=$?
  echo "$tool: exit $rc, ${SECONDS} s; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool.log" | tail -1)"
  [ $rc -eq 0 ] || status=1
done
exit $status
