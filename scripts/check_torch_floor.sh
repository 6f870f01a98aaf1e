#!/usr/bin/env bash
# The one-off check behind pyproject.toml's torch floor, on a CPU machine: a torch release
# (default 2.10.0, PyPI's CUDA wheel) runs the CPU test suite, and the kernels' host code and
# the optional C++ autograd compile against its headers and link against its libraries.
# The .cu files include no torch header, so they compile alike on every torch; CI compiles them.
#
# usage: scripts/check_torch_floor.sh [VERSION]
# env:   FLOOR_VENV  the virtual environment, reused between runs (default /tmp/fusedloss-torch-VERSION)
#        CUDA_HOME   CUDA headers for the host code (default: the nvcc on the PATH)
#        JOBS        pytest workers (default 2)
# Exit status: 0 when every step passes.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VERSION=${1:-2.10.0}
VENV=${FLOOR_VENV:-/tmp/fusedloss-torch-$VERSION}
# nvcc's own installation (nvcc on the PATH may be a wrapper script elsewhere)
CUDA=${CUDA_HOME:-$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==$VERSION" pytest pytest-xdist hypothesis expecttest numpy
fi
PY=$VENV/bin/python
echo "== torch $("$PY" -c 'import torch; print(torch.__version__)'), CUDA headers from $CUDA"

echo "== the CPU suite"
(cd "$REPO" && PYTHONPATH=src "$PY" -m pytest -q -p no:cacheprovider -n "${JOBS:-2}" tests | tail -3)

echo "== the kernels' host code against this torch's headers (the build's flags)"
flags=$(cd "$REPO" && PYTHONPATH=src "$PY" - <<'EOF'
import torch
from torch.utils import cpp_extension
from fusedloss import build
paths = cpp_extension.include_paths("cuda")
print(" ".join(["-std=c++17", "-fPIC", "-DTORCH_API_INCLUDE_EXTENSION_H",
                f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                *build.COMMON_FLAGS, *(f"-isystem {p}" for p in paths)]))
EOF
)
for source in plain_ops weighted_ops likelihood_ops; do
  start=$SECONDS
  # shellcheck disable=SC2086
  ${CXX:-c++} $flags -isystem "$CUDA/include" -c "$REPO/src/fusedloss/csrc/$source.cpp" -o "$WORK/$source.o"
  echo "$source.cpp: compiled in $((SECONDS - start)) s"
done

echo "== the C++ autograd, built and loaded as python -m fusedloss build builds it"
(cd "$REPO" && TORCH_EXTENSIONS_DIR=$WORK/extensions PYTHONPATH=src "$PY" - <<'EOF'
import torch
from fusedloss import build
library = build.cxx_autograd_library()
library.parent.mkdir(parents=True, exist_ok=True)
build._compile_cxx_autograd(library)
torch.ops.load_library(str(library))
assert hasattr(torch.ops.fusedloss_cxx, "reduced_loss"), "the C++ autograd registered no operator"
print(f"loaded {library.name} on torch {torch.__version__}")
EOF
)
echo "== torch $VERSION: pass"
