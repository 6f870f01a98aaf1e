#!/usr/bin/env bash
# The CUDA 12 wheel, on a machine with no CUDA 12 toolkit and no GPU. NVIDIA's pip packages for
# CUDA 12 carry ptxas but no nvcc, so the compiler comes from Debian's packaging of CUDA 12.4
# (trixie, non-free; the files are NVIDIA's, checked against the SHA-256 sums below), unpacked
# into a toolkit directory without installing anything. The kernels are built against a CUDA 12
# build of torch (PyPI's torch 2.10.0, CUDA 12.8; nvcc 12.4 is the same major) and tagged by
# scripts/build_wheel.sh. The wheel loads on every torch of CUDA 12 from the stable ABI's floor up.
#
# usage: scripts/build_wheel_cu12.sh [OUT_DIR]   (default dist-cu12/)
# env:   CUDA12_DIR   the unpacked toolkit, reused between runs (default /tmp/fusedloss-cuda-12.4)
#        CU12_VENV    a virtual environment with a CUDA 12 torch (default /tmp/fusedloss-torch-2.10.0,
#                     which scripts/check_torch_floor.sh also uses; made with torch==2.10.0 if absent)
#        TORCH_CUDA_ARCH_LIST, MAX_JOBS   as for scripts/build_wheel.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-dist-cu12}")
toolkit=${CUDA12_DIR:-/tmp/fusedloss-cuda-12.4}
venv=${CU12_VENV:-/tmp/fusedloss-torch-2.10.0}
mirror=http://deb.debian.org/debian
packages=(
  "non-free/n/nvidia-cuda-toolkit/nvidia-cuda-toolkit_12.4.131~12.4.1-2_amd64.deb cd5fe85aee38d108b315f408a688641478f2402622a10c677478eb7a6c4e5319"
  "non-free/n/nvidia-cuda-toolkit/nvidia-cuda-dev_12.4.127~12.4.1-2_amd64.deb d846838f914a0176948d48a8bcade5d6dbcccb5c9374343f6475f5503f173ee0"
  "non-free/n/nvidia-cuda-toolkit/libnvvm4_12.4.131~12.4.1-2_amd64.deb 3c905c1df7453e1ad477516c4465629c310d2f58a796d66f44070dc289e7ec12"
  "non-free/n/nvidia-cuda-toolkit/libcudart12_12.4.127~12.4.1-2_amd64.deb 361b3721cf84bf068e111ff013c819de61cb475268b0d38db99839471f1b4130"
  "main/c/cccl/libcu++-dev_2.3.2-2_all.deb 30e911c1909265591b5ea793df0e49e56bed631238b68b3e75c97590c4985686"
  "main/c/cccl/libcub-dev_2.3.2-2_all.deb 4a7e7c24ef2994140e47dba59507db60e281f968f17c18cf1cadc9c27c17c26b"
  "main/c/cccl/libthrust-dev_2.3.2-2_all.deb 61fe44b65834efad9b079452ebec7396d4b37712d251421f4218b3bc652a3147"
)

if [ ! -x "$toolkit/bin/nvcc" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  for entry in "${packages[@]}"; do
    read -r path sum <<<"$entry"
    curl -fsSL -o "$work/pkg.deb" "$mirror/pool/$path"
    echo "$sum  $work/pkg.deb" | sha256sum --check --quiet
    dpkg-deb -x "$work/pkg.deb" "$work/root"
  done
  # NVIDIA's layout, which nvcc and torch's cpp_extension expect: bin/ (nvcc, cicc and the tools
  # beside it), include/, lib64/, nvvm/libdevice/, and an nvcc.profile that points there.
  root=$work/root
  mkdir -p "$toolkit/bin" "$toolkit/lib64" "$toolkit/nvvm/libdevice"
  cp "$root/usr/lib/nvidia-cuda-toolkit/bin/nvcc" "$root/usr/lib/nvidia-cuda-toolkit/bin/cicc" "$toolkit/bin/"
  cp -r "$root/usr/lib/nvidia-cuda-toolkit/bin/crt" "$toolkit/bin/"
  cp "$root"/usr/bin/{ptxas,fatbinary,cudafe++,nvlink,bin2c,nvprune,cuobjdump} "$toolkit/bin/"
  cp "$root"/usr/lib/nvidia-cuda-toolkit/libdevice/* "$toolkit/nvvm/libdevice/"
  cp -a "$root/usr/include" "$toolkit/include"
  cp -a "$root"/usr/lib/x86_64-linux-gnu/{libcudart*,libcudadevrt.a,libnvvm*} "$toolkit/lib64/"
  cat >"$toolkit/bin/nvcc.profile" <<'EOF'
TOP = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
LD_LIBRARY_PATH += $(TOP)/lib64:
PATH += $(_HERE_):
INCLUDES += "-I$(TOP)/include" $(_SPACE_)
LIBRARIES =+ $(_SPACE_) "-L$(TOP)/lib64"
EOF
fi
"$toolkit/bin/nvcc" --version | tail -2

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "torch==2.10.0"
fi
"$venv/bin/pip" install -q "setuptools>=77" wheel ninja
env CUDA_HOME="$toolkit" PATH="$toolkit/bin:$PATH" PYTHON="$venv/bin/python" bash scripts/build_wheel.sh "$out"
ls -l "$out"
