#!/usr/bin/env bash
# Compile-only check that a KernelBench ModelNew file (kernelbench/generated/*.py) holds the
# seed's floor, PyTorch 2.2 and CUDA 12.1, on a machine with no GPU and no CUDA toolkit.
#
# usage: scripts/check_kernelbench_floor.sh [FILE.py]   (default kernelbench/generated/94_MSELoss.py)
# env:   FLOOR_DIR  cache of the toolchains, reused between runs (default /tmp/fusedloss-floor)
#        OUT        where kernelbench_floor.log goes (default .)
#        KEEP_WORK=1 keep the temporary build directory (its path is in the log)
#
# A real nvcc 12.1 cannot be had from PyPI (nvidia-cuda-nvcc-cu12==12.1.105 ships ptxas and
# libnvvm only: no nvcc driver, cicc or cudafe++), so the floor is checked in three parts, each
# with the closest toolchain PyPI has:
#  1. host C++: CPP_SOURCE with g++ -std=c++17 exactly as torch 2.2.2's load_inline builds it for
#     a CUDA extension (its '#include <torch/extension.h>' prelude, torch 2.2.2 headers, CUDA 12.1
#     headers, its -D flags), and once more as the plain file, without the prelude.
#  2. CUDA_SOURCE with nvcc 13.0.88 (the only nvcc on PyPI) as torch 2.2.2's load_inline builds
#     it for an sm_90 GPU: its prelude, torch 2.2.2 headers, COMMON_NVCC_FLAGS, -std=c++17.
#     The CUDA headers here are 13.0's (nvcc needs its own crt/ and CCCL).
#  3. the device code with the CUDA 12.1 compilers: NVRTC 12.1.105 (the CUDA 12.1 front end and
#     NVVM) compiles CUDA_SOURCE against the CUDA 12.1 headers, then ptxas 12.1.105 compiles the
#     PTX for sm_90. What NVRTC is given differs from the file only where NVRTC needs it:
#       -default-device -rdc=true: the host launchers are compiled as device functions whose
#         <<<...>>> and cudaMemsetAsync are device-side launches (dynamic parallelism), so NVRTC
#         instantiates every kernel exactly as the launchers do;
#       --device-int128 (nvcc allows __int128 in device code by default on Linux);
#       no --expt-relaxed-constexpr (NVRTC 12.1 has no such option; the code does not need it);
#       minimal stand-ins for the C++ standard headers NVRTC lacks (<type_traits>, <cstdint>,
#         <cfloat>, <cmath>, <algorithm>, <array>, <atomic>), defining only what the kernels use;
#       the middling reduction's cooperative launch, a host-only function, calls a device-side
#         declaration of the same signature instead (the kernel's address is taken as before,
#         so NVRTC instantiates it), and the occupancy query is handed the kernel as the
#         const void* of the device runtime's own declaration;
#       load_inline's host prelude (torch/types.h, cuda.h, cuda_runtime.h) is left out.
#     Not checked with CUDA 12.1: the host side of CUDA_SOURCE as nvcc 12.1's cudafe++/g++ pair
#     would split and compile it (step 2 does that with nvcc 13.0).
# Exit status: 0 when every step passes.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FILE=$(readlink -f "${1:-$REPO/kernelbench/generated/94_MSELoss.py}")
FLOOR_DIR=${FLOOR_DIR:-/tmp/fusedloss-floor}
OUT_DIR=${OUT:-.}
mkdir -p "$OUT_DIR" "$FLOOR_DIR"
LOG=$(readlink -f "$OUT_DIR")/kernelbench_floor.log
PY=${PYTHON:-python3}
: >"$LOG"
[ -f "$FILE" ] || { echo "no such file: $FILE" >&2; exit 2; }

TORCH_VERSION=2.2.2
CUDA121_VERSION=12.1.105        # cuda-runtime, cuda-nvcc (crt headers, ptxas) and cuda-nvrtc
NVCC13_WHEELS=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
               nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85)
TORCH_DIR=$FLOOR_DIR/torch-$TORCH_VERSION
CU121=$FLOOR_DIR/cuda-12.1
CU13=$FLOOR_DIR/cuda-13.0

T_START=$SECONDS
log() { printf '%s\n' "$*" >>"$LOG"; }
say() { printf '%s\n' "$*"; log "$*"; }
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kbfloor.XXXXXX")
[ "${KEEP_WORK:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
log "== $(date -u +%FT%TZ) check_kernelbench_floor.sh $FILE"
log "== FLOOR_DIR=$FLOOR_DIR  work=$WORK"

# ---------------------------------------------------------------- toolchains (cached)
# Wheels are unzipped with Python (unix modes kept) and deleted once extracted; a tree counts as
# cached when its .done stamp exists.
cat >"$WORK/unwheel.py" <<'EOF'
import os, re, sys, zipfile
# unwheel.py DEST WHEEL PREFIX[=NEWPREFIX]...: extract the members under PREFIX into DEST/NEWPREFIX
dest, whl, maps = sys.argv[1], sys.argv[2], [m.split('=', 1) + [''] if '=' not in m else m.split('=', 1) for m in sys.argv[3:]]
n = 0
with zipfile.ZipFile(whl) as z:
    for info in z.infolist():
        if info.is_dir() or info.filename.endswith('__init__.py'):
            continue
        for old, new in ((m[0], m[1]) for m in maps):
            if info.filename == old or (old.endswith('/') and info.filename.startswith(old)):
                rel = new + info.filename[len(old):] if old.endswith('/') else new
                path = os.path.join(dest, rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with z.open(info) as src, open(path, 'wb') as out:
                    out.write(src.read())
                mode = (info.external_attr >> 16) & 0o777 or 0o644
                if '/bin/' in '/' + rel:
                    mode |= 0o755
                os.chmod(path, mode)
                n += 1
                break
print(f'{os.path.basename(whl)}: {n} files')
EOF

fetch() {  # fetch SPEC [pip options...]: download one wheel into $FLOOR_DIR/wheels, print its path
  local spec=$1; shift
  local d=$FLOOR_DIR/wheels/${spec//[=<>]/_}
  mkdir -p "$d"
  if ! ls "$d"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip download --no-deps --only-binary=:all: --no-cache-dir --disable-pip-version-check -q -d "$d" "$@" "$spec" >>"$LOG" 2>&1 \
      || { echo "FAIL download $spec (pip download, see log)" | tee -a "$LOG" >&2; return 1; }
  fi
  ls "$d"/*.whl | head -1
}

setup_torch() {
  [ -f "$TORCH_DIR/.done" ] && return 0
  rm -rf "$TORCH_DIR"; mkdir -p "$TORCH_DIR"
  local w; w=$(fetch "torch==$TORCH_VERSION" --python-version 3.11 --implementation cp --abi cp311 \
                 --platform manylinux1_x86_64) || return 1
  "$PY" "$WORK/unwheel.py" "$TORCH_DIR" "$w" torch/include/=include/ torch/utils/cpp_extension.py=cpp_extension.py \
    torch/version.py=version.py >>"$LOG" || return 1
  # torch._C._PYBIND11_{COMPILER_TYPE,STDLIB,BUILD_ABI}, which load_inline passes as -DPYBIND11_*:
  # the strings compiled into libtorch_python.so.
  "$PY" - "$w" >"$TORCH_DIR/pybind11_abi.txt" <<'EOF' || return 1
import re, sys, zipfile
data = zipfile.ZipFile(sys.argv[1]).read('torch/lib/libtorch_python.so')
vals = {}
for key, pat in (('COMPILER_TYPE', rb'\x00(_gcc|_clang|_icc)\x00'), ('STDLIB', rb'\x00(_libstdcpp|_libcpp)\x00'),
                 ('BUILD_ABI', rb'\x00(_cxxabi10\d\d)\x00')):
    found = sorted(set(re.findall(pat, data)))
    if len(found) != 1:
        sys.exit(f'libtorch_python.so: {key}: {found}')
    vals[key] = found[0].decode()
for k, v in vals.items():
    print(f'{k}={v}')
EOF
  rm -f "$w"; touch "$TORCH_DIR/.done"
}

setup_cuda121() {
  [ -f "$CU121/.done" ] && return 0
  rm -rf "$CU121"; mkdir -p "$CU121"
  local w
  w=$(fetch "nvidia-cuda-runtime-cu12==$CUDA121_VERSION") || return 1
  "$PY" "$WORK/unwheel.py" "$CU121" "$w" nvidia/cuda_runtime/include/=include/ >>"$LOG" || return 1; rm -f "$w"
  w=$(fetch "nvidia-cuda-nvcc-cu12==$CUDA121_VERSION") || return 1
  "$PY" "$WORK/unwheel.py" "$CU121" "$w" nvidia/cuda_nvcc/include/=include/ nvidia/cuda_nvcc/bin/ptxas=bin/ptxas >>"$LOG" || return 1; rm -f "$w"
  w=$(fetch "nvidia-cuda-nvrtc-cu12==$CUDA121_VERSION") || return 1
  "$PY" "$WORK/unwheel.py" "$CU121" "$w" nvidia/cuda_nvrtc/lib/=lib/ >>"$LOG" || return 1; rm -f "$w"
  touch "$CU121/.done"
}

setup_cuda13() {
  [ -f "$CU13/.done" ] && return 0
  rm -rf "$CU13"; mkdir -p "$CU13"
  local spec w
  for spec in "${NVCC13_WHEELS[@]}"; do
    w=$(fetch "$spec") || return 1
    "$PY" "$WORK/unwheel.py" "$CU13" "$w" nvidia/cu13/= >>"$LOG" || return 1; rm -f "$w"
  done
  touch "$CU13/.done"
}

t0=$SECONDS
cached=yes; for s in "$TORCH_DIR/.done" "$CU121/.done" "$CU13/.done"; do [ -f "$s" ] || cached=no; done
setup_torch && setup_cuda121 && setup_cuda13 || { say "FAIL toolchain setup (see $LOG)"; exit 1; }
rm -rf "$FLOOR_DIR/wheels"
say "toolchains: torch $TORCH_VERSION headers, CUDA 12.1 headers/NVRTC/ptxas, nvcc 13.0 in $FLOOR_DIR ($([ $cached = yes ] && echo cached || echo "fetched in $((SECONDS - t0))s"), $(du -sh "$FLOOR_DIR" | cut -f1))"

# ---------------------------------------------------------------- the file's sources and flags
"$PY" - "$FILE" "$WORK" "$TORCH_DIR" <<'EOF' >>"$LOG" 2>&1 || { say "FAIL reading CPP_SOURCE/CUDA_SOURCE/NAMESPACE from $FILE"; exit 1; }
# Module-level string assignments, read with ast (torch is not imported). COMMON_FLAGS, when the
# file has one, is evaluated from string constants and NAMESPACE; the extension name is the one
# load_kernels() computes on an sm_90 GPU under torch 2.2.2 (it only names the module).
import ast, hashlib, re, sys
path, work, torch_dir = sys.argv[1:4]
consts, exprs = {}, {}
for node in ast.parse(open(path).read()).body:
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        exprs[node.targets[0].id] = node.value
        try:
            v = ast.literal_eval(node.value)
            if isinstance(v, str):
                consts[node.targets[0].id] = v
        except ValueError:
            pass
for k in ('CPP_SOURCE', 'CUDA_SOURCE', 'NAMESPACE'):
    if k not in consts:
        sys.exit(f'{path}: no module-level string {k}')
def ev(n):
    if isinstance(n, ast.Constant) and isinstance(n.value, str): return n.value
    if isinstance(n, ast.Name) and n.id in consts: return consts[n.id]
    if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add): return ev(n.left) + ev(n.right)
    raise ValueError(ast.dump(n))
ns = consts['NAMESPACE']
try:
    flags = [ev(e) for e in exprs['COMMON_FLAGS'].elts]
except (KeyError, AttributeError, ValueError):
    flags = ['-O3', f'-DFUSEDLOSS_OPS_NAMESPACE={ns}']
ver = dict(re.findall(r"^(__version__|cuda)\b[^=\n]*=\s*'([^']*)'", open(f'{torch_dir}/version.py').read(), re.M))
cuda_flags = flags + ['-gencode=arch=compute_90,code=sm_90']
fp = '\0'.join([consts['CPP_SOURCE'], consts['CUDA_SOURCE'], *cuda_flags, ver['__version__'], ver['cuda']])
name = 'fusedloss_kernelbench_' + hashlib.sha256(fp.encode()).hexdigest()[:16]
open(f'{work}/source.cpp', 'w').write(consts['CPP_SOURCE'])
open(f'{work}/source.cu', 'w').write(consts['CUDA_SOURCE'])
open(f'{work}/flags.txt', 'w').write('\n'.join(flags) + '\n')
open(f'{work}/cuda_flags.txt', 'w').write('\n'.join(cuda_flags) + '\n')
open(f'{work}/ext_name.txt', 'w').write(name + '\n')
print(f'read {path}: NAMESPACE={ns} CPP_SOURCE {len(consts["CPP_SOURCE"])} chars, CUDA_SOURCE '
      f'{len(consts["CUDA_SOURCE"])} chars, extra_cflags {flags}, extra_cuda_cflags {cuda_flags}, '
      f'name {name} (torch {ver["__version__"]}, CUDA {ver["cuda"]})')
EOF
mapfile -t EXTRA_CFLAGS <"$WORK/flags.txt"
mapfile -t EXTRA_CUDA_CFLAGS <"$WORK/cuda_flags.txt"
EXT_NAME=$(cat "$WORK/ext_name.txt")

# ---------------------------------------------------------------- torch 2.2.2's load_inline, read from its source
"$PY" - "$TORCH_DIR/cpp_extension.py" "$WORK" <<'EOF' >>"$LOG" 2>&1 || { say "FAIL reading torch $TORCH_VERSION cpp_extension.py"; exit 1; }
# The preludes load_inline inserts and COMMON_NVCC_FLAGS, taken from torch 2.2.2's own file.
import ast, re, sys
src = open(sys.argv[1]).read()
cpp = re.findall(r"cpp_sources\.insert\(0, '([^']*)'\)", src)
cu = [s for _, s in sorted(re.findall(r"cuda_sources\.insert\((\d), '([^']*)'\)", src))]
nvcc = next(ast.literal_eval(n.value) for n in ast.parse(src).body if isinstance(n, ast.Assign)
            and getattr(n.targets[0], 'id', '') == 'COMMON_NVCC_FLAGS')
assert cpp == ['#include <torch/extension.h>'] and len(cu) == 3, (cpp, cu)
# _write_ninja_file_to_build_library: cflags get '-fPIC', '-std=c++17'; cuda flags get
# "--compiler-options '-fPIC'" and -std=c++17 when none is given.
assert "cflags = common_cflags + ['-fPIC', '-std=c++17'] + extra_cflags" in src
assert "if not any(flag.startswith('-std=') for flag in cuda_flags):" in src
open(f'{sys.argv[2]}/prelude.cpp', 'w').write('\n'.join(cpp) + '\n')
open(f'{sys.argv[2]}/prelude.cu', 'w').write('\n'.join(cu) + '\n')
open(f'{sys.argv[2]}/common_nvcc_flags.txt', 'w').write('\n'.join(nvcc) + '\n')
print('torch load_inline prelude: cpp', cpp, 'cuda', cu, '; COMMON_NVCC_FLAGS', nvcc)
EOF
mapfile -t COMMON_NVCC_FLAGS <"$WORK/common_nvcc_flags.txt"
# load_inline writes "\n".join([prelude..., source])
{ cat "$WORK/prelude.cpp"; cat "$WORK/source.cpp"; } >"$WORK/main.cpp"
{ cat "$WORK/prelude.cu"; cat "$WORK/source.cu"; } >"$WORK/cuda.cu"

PYINC=$("$PY" -c "import sysconfig; print(sysconfig.get_path('include', scheme='posix_prefix'))")
PYBIND=()
while IFS== read -r k v; do PYBIND+=("-DPYBIND11_$k=\"$v\""); done <"$TORCH_DIR/pybind11_abi.txt"
TI=$TORCH_DIR/include
common_cflags() {  # $1: the CUDA home whose include/ include_paths(cuda=True) adds
  printf '%s\n' "-DTORCH_EXTENSION_NAME=$EXT_NAME" -DTORCH_API_INCLUDE_EXTENSION_H "${PYBIND[@]}" \
    -isystem "$TI" -isystem "$TI/torch/csrc/api/include" -isystem "$TI/TH" -isystem "$TI/THC" \
    -isystem "$1/include" -isystem "$PYINC" -D_GLIBCXX_USE_CXX11_ABI=0
}
mapfile -t COMMON_CPP < <(common_cflags "$CU121")
mapfile -t COMMON_CU < <(common_cflags "$CU13")
# No system CUDA: a clean environment whose PATH has no /usr/local.
CLEAN=(env -i HOME="$HOME" LANG=C LC_ALL=C PATH="$CU13/bin:/usr/bin:/bin" TMPDIR="$WORK")

# ---------------------------------------------------------------- the steps (run concurrently)
run_step() {  # run_step TAG COMMAND...: output to $WORK/TAG.out, "rc seconds" to $WORK/TAG.rc
  local tag=$1; shift; local t=$SECONDS
  { printf '$ '; printf '%q ' "$@"; echo; } >"$WORK/$tag.cmd"
  "${CLEAN[@]}" "$@" >"$WORK/$tag.out" 2>&1
  echo "$? $((SECONDS - t))" >"$WORK/$tag.rc"
}

step1() {  # $1 tag, $2 source
  run_step "$1" "${CXX:-g++}" -MMD -MF "$WORK/$1.d" "${COMMON_CPP[@]}" -fPIC -std=c++17 "${EXTRA_CFLAGS[@]}" \
    -c "$2" -o "$WORK/$1.o"
}

# torch 2.2.2 _get_cuda_arch_flags() on one sm_90 GPU with TORCH_CUDA_ARCH_LIST unset: "9.0+PTX".
ARCH_FLAGS=(-gencode=arch=compute_90,code=compute_90 -gencode=arch=compute_90,code=sm_90)
step2() {
  local flags=("${COMMON_CU[@]}" "${COMMON_NVCC_FLAGS[@]}" "${ARCH_FLAGS[@]}" --compiler-options -fPIC "${EXTRA_CUDA_CFLAGS[@]}")
  printf '%s\n' "${flags[@]}" | grep -q '^-std=' || flags+=(-std=c++17)
  # --resource-usage only prints ptxas' per-kernel summary (to count the kernels).
  run_step nvcc "$CU13/bin/nvcc" --generate-dependencies-with-compile --dependency-output "$WORK/nvcc.d" \
    "${flags[@]}" --resource-usage -c "$WORK/cuda.cu" -o "$WORK/cuda.cuda.o"
}

# NVRTC driver: compiles, writes the PTX and the log, lists the kernels (PTX .entry definitions).
cat >"$WORK/nvrtc.py" <<'EOF'
import ctypes, re, sys
lib_path, src_path, ptx_path = sys.argv[1:4]
opts = sys.argv[4:]
lib = ctypes.CDLL(lib_path)
lib.nvrtcGetErrorString.restype = ctypes.c_char_p
major, minor = ctypes.c_int(), ctypes.c_int()
lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
print(f'NVRTC {major.value}.{minor.value} ({lib_path})')
print('options:', ' '.join(opts))
prog = ctypes.c_void_p()
src = open(src_path, 'rb').read()
assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, b'cuda_source.cu', 0, None, None) == 0
copts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
rc = lib.nvrtcCompileProgram(prog, len(opts), copts)
size = ctypes.c_size_t()
lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
buf = ctypes.create_string_buffer(size.value)
lib.nvrtcGetProgramLog(prog, buf)
text = buf.value.decode(errors='replace').strip()
print('--- NVRTC log ---' + ('\n' + text if text else ' (empty)'))
print(f'nvrtcCompileProgram: {lib.nvrtcGetErrorString(rc).decode()}')
if rc != 0:
    sys.exit(1)
lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
buf = ctypes.create_string_buffer(size.value)
lib.nvrtcGetPTX(prog, buf)
ptx = buf.value.decode()
open(ptx_path, 'w').write(ptx)
entries = re.findall(r'\.entry\s+([\w$]+)\s*\([^()]*\)[^{;]*\{', ptx)
open(ptx_path + '.entries', 'w').write('\n'.join(sorted(entries)) + '\n')
print(f'PTX: {len(ptx)} bytes, {len(entries)} .entry definitions ({len(set(entries))} distinct)')
EOF

# Minimal stand-ins for the standard headers NVRTC 12.1 does not ship: only the names the
# kernels use.
mkdir -p "$WORK/nvrtc-std"
cat >"$WORK/nvrtc-std/type_traits" <<'EOF'
#pragma once
namespace std {
template <class T, T v> struct integral_constant {
  static constexpr T value = v;
  using value_type = T;
  using type = integral_constant;
  constexpr operator value_type() const noexcept { return value; }
  constexpr value_type operator()() const noexcept { return value; }
};
using true_type = integral_constant<bool, true>;
using false_type = integral_constant<bool, false>;
template <class A, class B> struct is_same : false_type {};
template <class A> struct is_same<A, A> : true_type {};
template <class A, class B> inline constexpr bool is_same_v = is_same<A, B>::value;
template <bool B, class T, class F> struct conditional { using type = T; };
template <class T, class F> struct conditional<false, T, F> { using type = F; };
template <bool B, class T, class F> using conditional_t = typename conditional<B, T, F>::type;
template <bool B, class T = void> struct enable_if {};
template <class T> struct enable_if<true, T> { using type = T; };
template <bool B, class T = void> using enable_if_t = typename enable_if<B, T>::type;
}  // namespace std
EOF
cat >"$WORK/nvrtc-std/cstdint" <<'EOF'
#pragma once
// as glibc defines them on x86_64 (LP64)
typedef signed char int8_t; typedef short int16_t; typedef int int32_t; typedef long int64_t;
typedef unsigned char uint8_t; typedef unsigned short uint16_t; typedef unsigned int uint32_t;
typedef unsigned long uint64_t; typedef long intptr_t; typedef unsigned long uintptr_t;
namespace std {
using ::int8_t; using ::int16_t; using ::int32_t; using ::int64_t; using ::uint8_t; using ::uint16_t;
using ::uint32_t; using ::uint64_t; using ::intptr_t; using ::uintptr_t;
}  // namespace std
EOF
cat >"$WORK/nvrtc-std/cfloat" <<'EOF'
#pragma once
#define FLT_MAX 3.40282346638528859811704183484516925e+38F
#define FLT_MIN 1.17549435082228750796873653722224568e-38F
#define DBL_MAX ((double)1.79769313486231570814527423731704357e+308L)
#define DBL_MIN ((double)2.22507385850720138309023271733240406e-308L)
EOF
cat >"$WORK/nvrtc-std/cmath" <<'EOF'
#pragma once
// isnan, ldexp, ... are NVRTC's built-in CUDA math functions; NAN and INFINITY as glibc's floats.
#define INFINITY (__int_as_float(0x7f800000))
#define NAN (__int_as_float(0x7fc00000))
EOF
cat >"$WORK/nvrtc-std/algorithm" <<'EOF'
#pragma once
namespace std {
template <class T> constexpr const T& min(const T& a, const T& b) { return b < a ? b : a; }
template <class T> constexpr const T& max(const T& a, const T& b) { return a < b ? b : a; }
}  // namespace std
EOF
cat >"$WORK/nvrtc-std/array" <<'EOF'
#pragma once
namespace std {
template <class T, unsigned long N> struct array {
  T elems[N];
  constexpr unsigned long size() const noexcept { return N; }
  T& operator[](unsigned long i) noexcept { return elems[i]; }
  const T& operator[](unsigned long i) const noexcept { return elems[i]; }
};
}  // namespace std
EOF
cat >"$WORK/nvrtc-std/atomic" <<'EOF'
#pragma once
// Only what the host launchers use; as device code they run on one thread per launch.
namespace std {
enum memory_order { memory_order_relaxed, memory_order_acquire, memory_order_release, memory_order_seq_cst };
template <class T> struct atomic {
  T value;
  T load(memory_order = memory_order_seq_cst) const noexcept { return value; }
  void store(T v, memory_order = memory_order_seq_cst) noexcept { value = v; }
};
}  // namespace std
EOF
# The source as NVRTC takes it: the host-only cooperative launch and occupancy query replaced
# (see the header), nothing else.
"$PY" - "$WORK/source.cu" "$WORK/nvrtc_source.cu" <<'EOF'
import re, sys
src = open(sys.argv[1]).read()
src = src.replace('cudaLaunchCooperativeKernel(', 'fusedloss_nvrtc_cooperative_launch(')
src = re.sub(r'cudaOccupancyMaxActiveBlocksPerMultiprocessor\(([^,]+),\s*([^,]+),',
             r'cudaOccupancyMaxActiveBlocksPerMultiprocessor(\1, reinterpret_cast<const void*>(\2),', src)
stand_in = ('#include <cuda_runtime.h>\n'
            'extern __device__ cudaError_t fusedloss_nvrtc_cooperative_launch(const void*, dim3, dim3, void**, '
            'size_t, cudaStream_t);\n')
open(sys.argv[2], 'w').write(stand_in + src)
EOF

step3() {
  local missing=() h
  for h in $(grep -oE '^\s*#\s*include\s*<[^>.]+>' "$WORK/nvrtc_source.cu" | sed -E 's/.*<(.*)>/\1/' | sort -u); do
    [ -f "$WORK/nvrtc-std/$h" ] || [ -f "$CU121/include/$h" ] || missing+=("<$h>")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "no NVRTC stand-in for ${missing[*]}" >"$WORK/nvrtc.out"; echo "1 0" >"$WORK/nvrtc.rc"; return
  fi
  local defs=() f
  for f in "${COMMON_NVCC_FLAGS[@]}" "${EXTRA_CUDA_CFLAGS[@]}"; do [[ $f == -D* ]] && defs+=("$f"); done
  NVRTC_OPTS=(-std=c++17 --gpu-architecture=compute_90 -default-device -rdc=true --device-int128
    "-DTORCH_EXTENSION_NAME=$EXT_NAME" -DTORCH_API_INCLUDE_EXTENSION_H "${defs[@]}"
    "-I$WORK/nvrtc-std" "-I$CU121/include")
  local nv=(env "LD_LIBRARY_PATH=$CU121/lib" "$PY" "$WORK/nvrtc.py" "$CU121/lib/libnvrtc.so.12")
  run_step nvrtc "${nv[@]}" "$WORK/nvrtc_source.cu" "$WORK/nvrtc.ptx" "${NVRTC_OPTS[@]}"
  read -r rc _ <"$WORK/nvrtc.rc"
  [ "$rc" = 0 ] || return
  run_step ptxas "$CU121/bin/ptxas" -arch=sm_90 -c -O3 -v "$WORK/nvrtc.ptx" -o "$WORK/nvrtc.cubin"
}

T_STEPS=$SECONDS
step1 cpp_inline "$WORK/main.cpp" &
step1 cpp_plain "$WORK/source.cpp" &
step2 &
step3 &
wait
log "== steps took $((SECONDS - T_STEPS))s wall"

# ---------------------------------------------------------------- report
FAILED=0
res() { read -r RC SECS <"$WORK/$1.rc" 2>/dev/null || { RC=missing; SECS=0; }; }
show() {  # show TAG TITLE: command and output into the log
  log ""; log "==== $2"
  [ -f "$WORK/$1.cmd" ] && cat "$WORK/$1.cmd" >>"$LOG"
  [ -f "$WORK/$1.out" ] && cat "$WORK/$1.out" >>"$LOG"
  res "$1"; log "==== rc=$RC (${SECS}s)"
}
verdict() {  # verdict OK? LINE
  if [ "$1" = 0 ]; then say "PASS $2"; else say "FAIL $2"; FAILED=1; fi
}
errs() { grep -E '(error|Error|ERROR)' "$WORK/$1.out" 2>/dev/null | head -5 | sed 's/^/    /'; }
syscuda() { cat "$WORK"/*.d 2>/dev/null | grep -q '/usr/local/cuda' && echo ' [ERROR: a /usr/local/cuda header was used]'; }

show cpp_inline "1a. host C++: load_inline's main.cpp (prelude + CPP_SOURCE), g++"
res cpp_inline; rc1a=$RC; [ "$rc1a" = 0 ] && grep -q /usr/local/cuda "$WORK/cpp_inline.d" && rc1a=1
verdict "$rc1a" "host C++ torch $TORCH_VERSION (load_inline prelude): g++ $(g++ -dumpfullversion) -std=c++17, torch $TORCH_VERSION + CUDA 12.1 headers (${SECS}s)"
[ "$rc1a" = 0 ] || errs cpp_inline

show cpp_plain "1b. host C++: CPP_SOURCE alone, g++"
res cpp_plain; rc1b=$RC; [ "$rc1b" = 0 ] && grep -q /usr/local/cuda "$WORK/cpp_plain.d" && rc1b=1
verdict "$rc1b" "host C++ torch $TORCH_VERSION (plain CPP_SOURCE, no prelude) (${SECS}s)"
[ "$rc1b" = 0 ] || errs cpp_plain

show nvcc "2. CUDA source: load_inline's cuda.cu (prelude + CUDA_SOURCE), nvcc 13.0"
res nvcc; rc2=$RC; [ "$rc2" = 0 ] && grep -q /usr/local/cuda "$WORK/nvcc.d" && rc2=1
grep -oE "Compiling entry function '[^']+' for 'sm_90'" "$WORK/nvcc.out" 2>/dev/null | cut -d"'" -f2 | sort -u >"$WORK/nvcc.entries"
N2=$(wc -l <"$WORK/nvcc.entries")
verdict "$rc2" "CUDA source nvcc $("${CLEAN[@]}" "$CU13/bin/nvcc" --version | grep -oE 'V[0-9.]+' | tr -d V) -std=c++17, torch $TORCH_VERSION headers/flags/prelude, sm_90: $N2 kernels (${SECS}s)"
[ "$rc2" = 0 ] || errs nvcc

show nvrtc "3. NVRTC 12.1 on the device code"
res nvrtc; rc3=$RC
N3=0; [ -f "$WORK/nvrtc.ptx.entries" ] && N3=$(wc -l <"$WORK/nvrtc.ptx.entries")
kinds=""
if [ "$N3" -gt 0 ]; then
  kinds=$(c++filt <"$WORK/nvrtc.ptx.entries" | sed -E 's/^(void )?([a-zA-Z_:]+)<.*/\2/; s/^.*:://' | sort | uniq -c |
          awk '{printf "%s%s %s", (NR>1?", ":""), $1, $2}')
  log "kernels by template: $kinds"; log "kernels (mangled):"; cat "$WORK/nvrtc.ptx.entries" >>"$LOG"
fi
[ "$rc3" = 0 ] && [ "$N3" = 0 ] && rc3=1   # compiled, but no kernel was instantiated
verdict "$rc3" "device code NVRTC 12.1.105 (CUDA 12.1 front end + NVVM, 12.1 headers, -std=c++17 compute_90 -default-device -rdc): $N3 kernels instantiated (PTX .entry) (${SECS}s)"
[ "$N3" -gt 0 ] && say "     $kinds"
[ "$rc3" = 0 ] || errs nvrtc

if [ "$rc3" = 0 ]; then
  show ptxas "3. ptxas 12.1 on NVRTC's PTX, sm_90"
  res ptxas; rc3b=$RC
  NP=$(grep -oE "Compiling entry function '[^']+' for 'sm_90'" "$WORK/ptxas.out" | sort -u | wc -l)
  verdict "$rc3b" "ptxas $("$CU121/bin/ptxas" --version | grep -oE 'V[0-9.]+' | tr -d V) sm_90 on that PTX: $NP entry functions (${SECS}s)"
  [ "$rc3b" = 0 ] || errs ptxas
  # kernel spills, ptxas 12.1 (rdc) vs nvcc 13.0, into the log
  "$PY" - "$WORK/ptxas.out" "$WORK/nvcc.out" <<'EOF' >>"$LOG" 2>&1
import re, sys
def spills(path):
    out, cur = {}, None
    for line in open(path, errors='replace'):
        m = re.search(r"Compiling entry function '([^']+)' for 'sm_90'", line)
        if m: cur = m.group(1); continue
        m = re.search(r'(\d+) bytes spill stores', line)
        if m and cur: out[cur] = int(m.group(1)); cur = None
    return out
a, b = spills(sys.argv[1]), spills(sys.argv[2])
print(f'(for information) kernels with spill stores: ptxas 12.1 (NVRTC PTX, -rdc) {sum(v > 0 for v in a.values())} of {len(a)}, '
      f'nvcc 13.0 {sum(v > 0 for v in b.values())} of {len(b)}')
EOF
  tail -1 "$LOG" | sed 's/^/     /'
  if [ "$rc2" = 0 ]; then
    # An anonymous namespace's mangled name carries the file's name: compared without it.
    unnamed() { sed -E 's/[0-9]+_GLOBAL__N__[0-9a-f]+_[0-9]+_[a-z_]+_([0-9a-f]{8})/_GLOBAL__N__\1/' "$1" | sort; }
    if cmp -s <(unnamed "$WORK/nvrtc.ptx.entries") <(unnamed "$WORK/nvcc.entries"); then
      say "PASS kernel sets agree: the $N3 kernels NVRTC 12.1 instantiated are the $N2 nvcc 13.0 compiled"
    else
      say "FAIL kernel sets differ: NVRTC 12.1 $N3, nvcc 13.0 $N2 (diff in log)"; FAILED=1
      diff "$WORK/nvrtc.ptx.entries" "$WORK/nvcc.entries" >>"$LOG"
    fi
  fi
fi

rm -rf "$FLOOR_DIR/wheels"
log ""; log "== total $((SECONDS - T_START))s"
if [ $FAILED = 0 ]; then say "RESULT PASS ($((SECONDS - T_START))s; log $LOG)"; else say "RESULT FAIL ($((SECONDS - T_START))s; log $LOG)"; fi
exit $FAILED
