#!/usr/bin/env bash
# CI: a wheel that carries the compiled kernels, built on a machine with no GPU against a
# CUDA build of torch with NVIDIA's pip compiler (scripts/ci_cuda_build.sh's environment),
# for sm_90, and tagged manylinux (scripts/build_wheel.sh); then installed into a fresh
# environment with no compiler to call: CUDA_HOME unset, no nvcc on the PATH, CXX a
# command that fails, an empty TORCH_EXTENSIONS_DIR.
# Fails unless the wheel carries the kernels, every operator gets its CUDA kernel from
# them, and nothing was compiled.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ci_torch.sh
builder=$CUDA_BUILD_VENV
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if ! "$builder/bin/python" -c "from fusedloss import build; build.find_toolkit()" 2>/dev/null; then
  echo "no CUDA build of torch with a compiler in $builder: run scripts/ci_cuda_build.sh first" >&2
  exit 1
fi

SECONDS=0
env -u CUDA_HOME -u CUDA_PATH TORCH_CUDA_ARCH_LIST=9.0 PYTHON="$builder/bin/python" bash scripts/build_wheel.sh \
  "$work/wheel"
wheel=$(ls "$work"/wheel/fusedloss-*.whl)
echo "built $(basename "$wheel") in ${SECONDS} s: $(du -m "$wheel" | cut -f1) MB"
case "$(basename "$wheel")" in
  *-cp310-abi3-manylinux_*_x86_64.whl) ;;
  *) echo "ci_wheel: the wheel is not tagged cp310-abi3 manylinux: $(basename "$wheel")" >&2; exit 1 ;;
esac
python3 -m zipfile -l "$wheel" | grep -E "fusedloss/(_[a-z]+_kernels[^ ]*\.so|_kernels\.json)"

python3 -m venv "$work/user"
"$work/user/bin/python" -m pip install -q "torch==$TORCH_VERSION" "$wheel"
printf '#!/bin/sh\nexit 1\n' > "$work/no-compiler"
chmod +x "$work/no-compiler"
mkdir "$work/cache"
env -u CUDA_HOME -u CUDA_PATH PATH="$work/user/bin:/usr/bin:/bin" CXX="$work/no-compiler" CC="$work/no-compiler" \
  TORCH_EXTENSIONS_DIR="$work/cache" "$work/user/bin/python" - <<'EOF'
import time

import torch

start = time.perf_counter()
from fusedloss import build

libraries = build.build("9.0", cxx_autograd=False)  # no GPU here: the architecture is named
seconds = time.perf_counter() - start
assert set(libraries) == set(build.FAMILIES), libraries
for library in libraries.values():
    assert library.name.endswith("_kernels.abi3.so") and library.parent.name == "fusedloss", library
missing = sorted(set(build.OPS) - set(build.registered_ops()))
assert not missing, f"no CUDA kernel for {missing}"
print(f"ci_wheel: import and load of the wheel's kernels took {seconds:.2f} s; all operators registered")
EOF
if [ -n "$(ls -A "$work/cache")" ]; then
  echo "ci_wheel: something was compiled into TORCH_EXTENSIONS_DIR: $(ls "$work/cache")" >&2
  exit 1
fi
echo "ci_wheel: the wheel's kernels loaded with no compiler, against torch $TORCH_VERSION; nothing compiled"
