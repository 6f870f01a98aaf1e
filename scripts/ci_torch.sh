# Sourced by CI's scripts: the newest torch installable here (a CUDA build), which the
# kernels compile against, the wheel is built against, and the sdist's tests run on, and
# the environment that holds it. Either may be set beforehand.
: "${TORCH_VERSION:=2.14.1}"
: "${CUDA_BUILD_VENV:=/tmp/fusedloss-ci-torch-$TORCH_VERSION}"
export TORCH_VERSION CUDA_BUILD_VENV
