#!/usr/bin/env bash
# CI: compile the real CUDA extension on a machine with no GPU and no system CUDA toolkit, as a
# user with nothing but pip would: the newest torch available here (a CUDA build), the compiler
# from the exact pip command fusedloss's fallback warning prints, the system toolkit hidden in a
# private mount namespace. Fails if a kernel does not compile, the pip compiler is not the one
# used, or an operator does not register.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ci_torch.sh
venv=$CUDA_BUILD_VENV
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q "torch==$TORCH_VERSION" ninja
"$venv/bin/python" -m pip install -q --no-deps -e .
install=$("$venv/bin/python" -c "from fusedloss import build; print(build.toolkit_install_command())")
echo "+ $install"
eval "\"$venv/bin/python\" -m ${install}"

# Hide every CUDA toolkit outside pip: /usr/local/cuda* and nvcc on the PATH.
mkdir "$work/empty"
: > "$work/not-nvcc"
hide=""
for dir in /usr/local/cuda /usr/local/cuda-*; do
  [ -d "$dir" ] && hide+="mount --bind $work/empty $dir && "
done
for nvcc in $(which -a nvcc 2>/dev/null || true); do
  hide+="mount --bind $work/not-nvcc $nvcc && "
done
build="env -u CUDA_HOME -u CUDA_PATH TORCH_EXTENSIONS_DIR=$work/cache $venv/bin/python -m fusedloss build --arch 9.0"
if unshare -m true 2>/dev/null; then
  unshare -m bash -c "${hide}which nvcc && exit 3; test -e /usr/local/cuda/bin/nvcc && exit 3; $build" | tee "$work/build.log"
else  # no mount namespace: an explicit CUDA_HOME is the only place fusedloss then looks outside pip
  echo "unshare unavailable: hiding the system toolkit with CUDA_HOME=$work/empty"
  env CUDA_HOME="$work/empty" TORCH_EXTENSIONS_DIR="$work/cache" "$venv/bin/python" -m fusedloss build --arch 9.0 \
    | tee "$work/build.log"
fi
grep -q "compiled with: .*/site-packages/nvidia/cu[0-9]*/bin/nvcc" "$work/build.log"
echo "ci_cuda_build: kernels compiled for sm_90 with the pip nvcc against torch $TORCH_VERSION; all operators registered"
