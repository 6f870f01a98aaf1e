"""Compiling and loading the CUDA kernels.

The kernels come in families (``FAMILIES``), one library each: the plain losses,
the weighted ones, and the Gaussian and Poisson likelihoods. Their host code uses only PyTorch's stable ABI
(``csrc/glue.h``, ``-DTORCH_TARGET_VERSION``), so one compiled library loads on
every torch from ``STABLE_ABI_FLOOR`` up.

A wheel built with its kernels (``setup.py``) carries every family: ``load()``
takes them when they fit the running torch (its CUDA major, and a version from
the floor up) and GPUs (``prebuilt``). Otherwise a family's files in ``csrc/``
are compiled on its first use with ``torch.utils.cpp_extension.load``, each
``.cu`` file once per input dtype (``shard_sources``), in parallel, for the
compute capabilities of the visible GPUs (or those named by
``TORCH_CUDA_ARCH_LIST`` or ``python -m fusedloss build --arch``): the plain
family on the first loss call, the others on the first call that needs them.
A build goes into ``$TORCH_EXTENSIONS_DIR/fusedloss_<family>_<hash>`` (torch's
default root when unset); the hash covers the sources, the flags, the
architectures and the torch, CUDA and Python versions, so a build is reused by
every later process, also one built ahead of time on a machine without a GPU,
and never by a different setup.

The compiler is the CUDA toolkit's nvcc (``CUDA_HOME``, ``nvcc`` on the PATH, or
``/usr/local/cuda``) or, without one, NVIDIA's pip packages of the compiler
for torch's CUDA version, from CUDA 13 on (``toolkit_install_command()`` names
them).

A build is never silent: it says on stderr, before compiling, what it compiles, for
which architectures, about how long that takes and where the result is cached,
and after compiling how long it took.

Processes that start together take an ``flock`` on the build directory: one
builds, the others wait and then load its library. The kernel drops the lock
of a process that dies, so a killed build cannot leave the others waiting.

A failed build is recorded in the build directory, keyed by the compiler, so
later processes fall back at once with the recorded error instead of
compiling again; ``python -m fusedloss build --force`` tries again. When the
kernels cannot be built or loaded, ``use_kernels()`` warns once with the cause
and the fix and returns False, and ``fusedloss.functional`` falls back to
``torch.nn.functional``. ``FUSEDLOSS_REQUIRE_KERNELS=1`` makes that an error.

Beside the kernels, an optional host-only library (``csrc/cxx_autograd.cpp``) gives
the paths of a small training step (a reduction whose forward writes no gradient,
weighted or not, ``reduction='none'``, the NLLs' fused pass) their autograd as C++
graph nodes, which saves that step the host time of a Python backward. It uses libtorch's C++ API, so
it is compiled per torch, with the host C++ compiler (``$CXX``, else ``c++``), never
nvcc: by ``python -m fusedloss build``, and beside a source build of the kernels. It
is loaded whenever it is cached for the running torch; without it (a wheel and no
``build`` run, no compiler, ``FUSEDLOSS_CXX_AUTOGRAD=0``) ``ops.py``'s autograd
serves, with the same results.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"

# The oldest torch whose stable ABI the host code targets: what it was compiled against
# must be at least this, and so must every torch that loads it.
STABLE_ABI_FLOOR = (2, 10)
# The C++ standard is torch's choice: each torch version asks for its own.
_TARGET_VERSION = f"-DTORCH_TARGET_VERSION=0x{STABLE_ABI_FLOOR[0]:02x}{STABLE_ABI_FLOOR[1]:02x}000000000000"
COMMON_FLAGS = ["-O3", _TARGET_VERSION]
# nvcc's -O is the host compiler's level: cicc and ptxas optimize the kernels either way
# (the same SASS at -O1 as at -O3). The .cu files' host side is only dispatch and
# launches, which -O1 compiles faster.
CUDA_FLAGS = ["-O1", _TARGET_VERSION]


@dataclass(frozen=True)
class Family:
    """One library of kernels: its host file, its CUDA files (the headers come in through
    #include), and the operators it gives a CUDA kernel."""

    name: str
    host_source: str
    cuda_sources: tuple[str, ...]
    ops: tuple[str, ...]

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.host_source, *self.cuda_sources)


FAMILIES = {
    "plain": Family(
        "plain", "plain_ops.cpp",
        ("pointwise_loss.cu", "pointwise_loss_backward.cu", "reduced_loss.cu", "reduced_loss_backward.cu",
         "reduced_loss_blockwise.cu", "reduced_loss_input_and_target_gradients.cu", "reduced_loss_input_gradient.cu",
         "reduced_loss_no_gradient.cu", "per_sample_loss.cu"),
        ("pointwise_loss", "pointwise_loss_backward", "reduced_loss", "reduced_loss_backward",
         "reduced_loss_backward_", "per_sample_loss"),
    ),
    "weighted": Family(
        "weighted", "weighted_ops.cpp",
        ("pointwise_loss_backward_broadcast.cu", "weighted_reduced_loss.cu", "weighted_reduced_loss_backward.cu",
         "weighted_reduced_loss_backward_input_gradient.cu", "weighted_reduced_loss_input_and_target_gradients.cu",
         "weighted_reduced_loss_input_gradient.cu"),
        ("weighted_loss", "weighted_loss_backward", "weighted_loss_backward_", "pointwise_loss_backward_broadcast"),
    ),
    "likelihood": Family(
        "likelihood", "likelihood_ops.cpp", ("likelihood_loss.cu",),
        ("likelihood_loss", "likelihood_loss_backward", "likelihood_loss_backward_", "likelihood_pointwise",
         "likelihood_pointwise_backward"),
    ),
}
OPS = tuple(op for family in FAMILIES.values() for op in family.ops)
# Each .cu file is compiled once per input dtype the kernels take, as the shard the
# FUSEDLOSS_SHARD macros of csrc/launch.h name (shards.h dispatches to them): many
# small objects compile in parallel where one large one would bound the build.
SHARDS = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "float64": "double"}

# What a wheel built with its kernels (setup.py) records beside them: the torch and CUDA
# versions they were compiled against, the stable ABI's floor, the architectures, and
# each family's library.
PREBUILT_RECORD = "_kernels.json"

REQUIRE_KERNELS_ENV = "FUSEDLOSS_REQUIRE_KERNELS"
FAILURE_RECORD = "build-failed-{compiler}.txt"

_loaded: dict[str, Path] = {}
_load_failures: dict[str, KernelsUnavailableError] = {}
_fallback_warned = False
_load_lock = threading.Lock()


class KernelsUnavailableError(RuntimeError):
    """The CUDA kernels could not be built or loaded; the message says why and how to fix it."""


class FallbackWarning(UserWarning):
    """fusedloss runs torch.nn.functional's losses because its kernels are unavailable."""


# ---- the compiler ---------------------------------------------------------------------


@dataclass(frozen=True)
class Toolkit:
    """A CUDA compiler and the headers and runtime library an extension builds against."""

    home: Path  # what torch.utils.cpp_extension takes as CUDA_HOME: home/bin/nvcc, home/include
    origin: str  # "system" or "pip"
    runtime_dir: Path | None = None  # libcudart.so.<major>, where home/lib has no libcudart.so

    @property
    def nvcc(self) -> Path:
        return self.home / "bin" / "nvcc"

    def identity(self) -> str:
        """What a recorded build failure is keyed by: this nvcc and the host compiler."""
        nvcc = self.nvcc.resolve()
        stat = nvcc.stat()
        host = os.environ.get("CXX") or shutil.which("c++") or "c++"
        text = "\0".join([str(nvcc), str(stat.st_size), str(stat.st_mtime_ns), str(Path(host).resolve())])
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def _torch_cuda_major() -> str:
    return (torch.version.cuda or "").split(".")[0]


def toolkit_install_command() -> str:
    """How to install a CUDA compiler matching this torch's CUDA version: NVIDIA's pip packages
    from CUDA 13 on; CUDA 12's pip packages hold no nvcc, so the toolkit there."""
    version = torch.version.cuda or "13.0"
    major, minor = version.split(".")[:2]
    if int(major) < 13:
        return f"the CUDA toolkit {major}.{minor} from NVIDIA, with CUDA_HOME set to its folder"
    packages = ("nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-cccl")
    return "pip install " + " ".join(f'"{name}=={major}.{minor}.*"' for name in packages)


def _system_cuda_homes() -> list[Path]:
    """Where a CUDA toolkit installed outside pip may be: CUDA_HOME or CUDA_PATH alone when
    set, else where nvcc on the PATH lives, else /usr/local/cuda."""
    explicit = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if explicit:
        return [Path(explicit)]
    homes = []
    nvcc = shutil.which("nvcc")
    if nvcc:  # a wrapper script may stand on the PATH: its real folder, then its own
        homes += [Path(nvcc).resolve().parent.parent, Path(nvcc).parent.parent]
    return [*homes, Path("/usr/local/cuda")]


def _pip_package_dirs() -> list[Path]:
    """The folders of the ``nvidia`` namespace package (NVIDIA's pip wheels), on sys.path."""
    spec = importlib.util.find_spec("nvidia")
    return [Path(p) for p in spec.submodule_search_locations] if spec and spec.submodule_search_locations else []


def _pip_toolkit(major: str) -> Toolkit | None:
    """NVIDIA's pip-installed compiler for CUDA `major`: nvcc, headers and runtime in nvidia/cu<major>/."""
    for root in _pip_package_dirs():
        home = root / f"cu{major}"
        if (home / "bin" / "nvcc").exists():
            return Toolkit(home, "pip", runtime_dir=home / "lib")
    return None


def find_toolkit() -> Toolkit:
    """The CUDA compiler to build with: a system toolkit, else NVIDIA's pip packages for torch's CUDA major."""
    if not torch.version.cuda:
        raise KernelsUnavailableError(
            f"torch {torch.__version__} is built without CUDA, so there is nothing to build the kernels against."
        )
    for home in _system_cuda_homes():
        if (home / "bin" / "nvcc").exists() and (home / "include" / "cuda_runtime.h").exists():
            return Toolkit(home, "system")
    found = _pip_toolkit(_torch_cuda_major())
    if found is not None:
        return found
    raise KernelsUnavailableError(
        f"nvcc was not found: no CUDA toolkit (CUDA_HOME, nvcc on the PATH, /usr/local/cuda) and no pip "
        f"package of NVIDIA's compiler for CUDA {torch.version.cuda}. Install "
        f"{toolkit_install_command()}"
    )


@contextmanager
def _cpp_extension_using(toolkit: Toolkit) -> Iterator[None]:
    """torch.utils.cpp_extension reads the toolkit from its module-level CUDA_HOME."""
    from torch.utils import cpp_extension

    saved = cpp_extension.CUDA_HOME
    cpp_extension.CUDA_HOME = str(toolkit.home)
    try:
        yield
    finally:
        cpp_extension.CUDA_HOME = saved


def cudart_link_flags(toolkit: Toolkit, directory: Path) -> list[str]:
    """cpp_extension links with -lcudart; the pip runtime ships only libcudart.so.<major>."""
    if toolkit.runtime_dir is None:
        return []
    runtime = sorted(toolkit.runtime_dir.glob("libcudart.so.*"))
    if not runtime:
        raise KernelsUnavailableError(f"no libcudart.so.* in {toolkit.runtime_dir}: reinstall it with "
                                      f"{toolkit_install_command()}")
    link_dir = directory / "cudart"
    link_dir.mkdir(exist_ok=True)
    link = link_dir / "libcudart.so"
    if not link.exists():
        link.symlink_to(runtime[0])
    return [f"-L{link_dir}", f"-Wl,-rpath,{toolkit.runtime_dir}"]


def _libstdcxx_flags() -> list[str]:
    """Link the C++ library this process runs with, where the compiler would link it statically.

    A host compiler without the shared libstdc++.so (a runtime-only image)
    links the static library into the extension. Two copies of the C++ library
    in one process disagree on locale facets: formatting a number into an
    error message then crashes. So name the loaded one explicitly.
    """
    host = os.environ.get("CXX") or "c++"
    try:
        found = subprocess.run([host, "-print-file-name=libstdc++.so"], capture_output=True, text=True).stdout
    except OSError:
        return []
    if os.path.isabs(found.strip()):
        return []
    with open("/proc/self/maps") as maps:
        loaded = next((line.split()[-1] for line in maps if "/libstdc++.so" in line), None)
    return [f"-L{os.path.dirname(loaded)}", f"-l:{os.path.basename(loaded)}"] if loaded else []


# ---- architectures and the build's name -----------------------------------------------


def arch_list(arch: str | None = None) -> list[str]:
    """Compute capabilities to build for, as "9.0" or "9.0+PTX": `arch` (";" or " "
    separated), else ``TORCH_CUDA_ARCH_LIST``, else those of the visible GPUs."""
    spec = arch or os.environ.get("TORCH_CUDA_ARCH_LIST")
    if spec:
        archs = [a for a in re.split(r"[;\s,]+", spec.strip()) if a]
        for a in archs:
            if not re.fullmatch(r"\d+\.\d+[a-z]?(\+PTX)?", a):
                raise ValueError(f"not a compute capability: {a!r} (expected for example 9.0 or 9.0+PTX)")
        return sorted(set(archs))
    capabilities = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return [f"{major}.{minor}" for major, minor in sorted(capabilities)]


def gencode_flags(archs: Sequence[str]) -> list[str]:
    """One ``-gencode`` per architecture, plus PTX for those marked ``+PTX``."""
    flags = []
    for arch in archs:
        number = arch.removesuffix("+PTX").replace(".", "")
        flags.append(f"-gencode=arch=compute_{number},code=sm_{number}")
        if arch.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{number},code=compute_{number}")
    return flags


def _source_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def build_name(archs: Sequence[str], family: str = "plain") -> str:
    """A family's build folder name: a hash of everything its library depends on but the compiler."""
    fingerprint = "\0".join([family, _source_digest(), *COMMON_FLAGS, *CUDA_FLAGS, *gencode_flags(archs),
                             torch.__version__, str(torch.version.cuda), sys.version.split()[0]])
    return f"fusedloss_{family}_" + hashlib.sha256(fingerprint.encode()).hexdigest()[:16]


def build_root() -> Path:
    """Where builds go: ``$TORCH_EXTENSIONS_DIR``, else torch's default root."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        # As torch.utils.cpp_extension.get_default_build_root, without importing that module.
        from torch import _appdirs

        root = os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions"))
    return Path(root)


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---- building ---------------------------------------------------------------------------


def _check_build_tools(toolkit: Toolkit, archs: Sequence[str]) -> None:
    """Fail early, with the fix, for what the build would otherwise fail on obscurely."""
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        raise KernelsUnavailableError("ninja was not found. Install it: pip install ninja")
    listed = subprocess.run([str(toolkit.nvcc), "--list-gpu-arch"], capture_output=True, text=True)
    if listed.returncode != 0:
        return  # an old nvcc without the flag: the build itself will tell
    supported = set(listed.stdout.split())
    for arch in archs:
        # nvcc lists the base architectures: 9.0a (sm_90a) is there when compute_90 is.
        number = re.sub(r"[a-z]$", "", arch.removesuffix("+PTX").replace(".", ""))
        if f"compute_{number}" not in supported:
            raise KernelsUnavailableError(
                f"compute capability {arch.removesuffix('+PTX')} is not one {toolkit.nvcc} can compile for "
                f"(it supports {', '.join(sorted(supported))}). Install a CUDA toolkit that supports it, "
                "or hide that GPU with CUDA_VISIBLE_DEVICES."
            )


def _first_error_lines(message: str, count: int = 3) -> str:
    # Compiler diagnostics ("x.cu(12): error: ...", "fatal error: ..."), not the command lines.
    errors = [line.strip() for line in message.splitlines() if "error:" in line or "error #" in line]
    return "\n  ".join(errors[:count] or message.strip().splitlines()[-count:])


# What each build's objects take, measured on a 16-core GPU host (nvcc 13.0, one
# architecture): the seconds of one core that all of them take, and the slowest one's.
_CORE_SECONDS = {"plain": (260, 16), "weighted": (525, 39), "likelihood": (30, 8)}
# The C++ autograd: one host compile, of one core.
_CXX_AUTOGRAD = "C++ autograd"
_CXX_AUTOGRAD_SECONDS = 8
# ninja's last objects start late: a build outlasts its work spread over the cores by
# about a fifth of its slowest object.
_TAIL_SHARE = 0.2


def _expected_seconds(archs: Sequence[str], family: str, beside: Sequence[str] = ()) -> int:
    """About how long a family's build takes here while the builds `beside` (other
    families, the C++ autograd) compile too. ninja builds run as many jobs each, so they
    share the cores evenly: this one ends once its own work and as much of each other's
    is done, or, on many cores, when its slowest object does."""
    total, slowest = (len(archs) * seconds for seconds in _CORE_SECONDS[family])
    shared = total + sum(_CXX_AUTOGRAD_SECONDS if other == _CXX_AUTOGRAD
                         else min(total, len(archs) * _CORE_SECONDS[other][0]) for other in beside)
    return round(max(slowest, shared / _cores() + _TAIL_SHARE * slowest))


def _expected_cxx_autograd_seconds(builds_beside: int) -> int:
    """About how long the C++ autograd's one compile takes beside `builds_beside` ninja
    builds, whose jobs (two more than the cores, each) share the cores with it."""
    jobs = 1 + builds_beside * (_cores() + 2)
    return round(_CXX_AUTOGRAD_SECONDS * max(1.0, jobs / _cores()))


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _say(line: str) -> None:
    print(f"fusedloss: {line}", file=sys.stderr, flush=True)


def shard_sources(family: Family, directory: Path) -> list[Path]:
    """The family's files to compile: its host file, and each .cu file once per shard, as
    a file in `directory` that names the shard and includes the .cu file."""
    directory.mkdir(parents=True, exist_ok=True)
    sources = [CSRC / family.host_source]
    for source in family.cuda_sources:
        for shard, input_type in SHARDS.items():
            path = directory / f"{Path(source).stem}.{shard}.cu"
            text = (f"#define FUSEDLOSS_SHARD shard_{shard}\n#define FUSEDLOSS_SHARD_INPUT {input_type}\n"
                    f'#include "{source}"\n')
            if not path.exists() or path.read_text() != text:
                path.write_text(text)
            sources.append(path)
    return sources


def _compile(name: str, directory: Path, toolkit: Toolkit, archs: Sequence[str], family: Family) -> None:
    from torch.utils.cpp_extension import load

    with _cpp_extension_using(toolkit):
        load(
            name=name,
            sources=[str(path) for path in shard_sources(family, directory / "shards")],
            extra_cflags=COMMON_FLAGS,
            extra_cuda_cflags=CUDA_FLAGS + gencode_flags(archs),
            extra_ldflags=cudart_link_flags(toolkit, directory) + _libstdcxx_flags(),
            extra_include_paths=[str(CSRC)],
            build_directory=str(directory),
            is_python_module=False,
        )


def _build_or_load(family: Family, archs: Sequence[str], force: bool = False, why: str = "",
                   beside: Sequence[str] = ()) -> Path:
    name = build_name(archs, family.name)
    directory = build_root() / name
    library = directory / f"{name}.so"
    done = directory / "build-complete"
    if done.exists() and not force:
        return _load_library(library, directory)
    toolkit = find_toolkit()
    directory.mkdir(parents=True, exist_ok=True)
    record = directory / FAILURE_RECORD.format(compiler=toolkit.identity())
    with _exclusive(directory / "build.flock"):
        if done.exists() and not force:
            return _load_library(library, directory)
        if record.exists() and not force:
            raise KernelsUnavailableError(
                f"an earlier build of the CUDA kernels with {toolkit.nvcc} failed (recorded in {record}):\n  "
                f"{record.read_text().strip()}\nRun `python -m fusedloss build --force` to try again."
            )
        done.unlink(missing_ok=True)
        record.unlink(missing_ok=True)
        # A baton file of torch's own, left by a build that was killed.
        (directory / "lock").unlink(missing_ok=True)
        try:
            _check_build_tools(toolkit, archs)
            targets = ", ".join("sm_" + a.removesuffix("+PTX").replace(".", "") + (" + PTX" if a.endswith("+PTX")
                                                                                  else "") for a in archs)
            _say(f"{why + ': ' if why else ''}compiling the {family.name} CUDA kernels for {targets} with "
                 f"{toolkit.nvcc}, once for this torch; about {_expected_seconds(archs, family.name, beside)} s here; "
                 f"cached in {directory}")
            start = time.perf_counter()
            _compile(name, directory, toolkit, archs, family)
            _say(f"compiled the {family.name} CUDA kernels in {time.perf_counter() - start:.0f} s")
        except Exception as error:
            lines = error.args[0] if isinstance(error, KernelsUnavailableError) else _first_error_lines(str(error))
            record.write_text(lines + "\n")
            if isinstance(error, KernelsUnavailableError):
                raise
            raise KernelsUnavailableError(
                f"compiling the {family.name} CUDA kernels in {directory} with {toolkit.nvcc} failed:\n  {lines}\n"
                f"Check that nvcc, the C++ compiler and torch fit together (torch {torch.__version__} was built "
                f"with CUDA {torch.version.cuda}), and report the error to fusedloss if they do."
            ) from error
        done.touch()
    return library


def _load_library(library: Path, directory: Path) -> Path:
    try:
        torch.ops.load_library(str(library))
    except OSError as error:
        raise KernelsUnavailableError(
            f"loading {library} failed ({error}). Delete {directory} to rebuild it."
        ) from error
    return library


# ---- the kernels a wheel carries --------------------------------------------------------


def _capability(arch: str) -> tuple[int, int]:
    """(major, minor) of an architecture written as "9.0", "9.0a" or "9.0+PTX"."""
    major, minor = re.sub(r"[a-z]$", "", arch.removesuffix("+PTX")).split(".")
    return int(major), int(minor)


def _covers(archs: Sequence[str], capability: tuple[int, int]) -> bool:
    """Whether code for `archs` runs on a GPU of `capability`: machine code for the same
    major and a minor at most its own, or PTX of an architecture at most its own."""
    for arch in archs:
        major, minor = _capability(arch)
        if (major == capability[0] and minor <= capability[1]) or (arch.endswith("+PTX") and (major, minor) <= capability):
            return True
    return False


def _version(text: str) -> tuple[int, int]:
    """(major, minor) of a version such as "2.11.0+cu130"."""
    major, minor = re.match(r"(\d+)\.(\d+)", text).groups()
    return int(major), int(minor)


def prebuilt(family: str = "plain", capabilities: Sequence[tuple[int, int]] | None = None) -> tuple[Path | None, str]:
    """The family's kernels this install carries (a wheel built with them, setup.py), when
    they fit this torch and GPUs of `capabilities` (default: the visible ones): (library,
    ""), or (None, why not)."""
    record_path = Path(__file__).parent / PREBUILT_RECORD
    if not record_path.exists():
        return None, "this install carries no compiled kernels"
    record = json.loads(record_path.read_text())
    library = record_path.parent / record["libraries"][family]
    floor = tuple(record["stable_abi_floor"])
    if _version(torch.__version__) < floor:
        return None, (f"the kernels this install carries need torch {floor[0]}.{floor[1]} or newer, not "
                      f"{torch.__version__}")
    if (torch.version.cuda or "").split(".")[0] != record["cuda"].split(".")[0]:
        return None, (f"the kernels this install carries are for CUDA {record['cuda'].split('.')[0]}, and this torch "
                      f"is built with {'CUDA ' + torch.version.cuda if torch.version.cuda else 'no CUDA'}")
    if not library.exists():
        return None, f"this install lacks {library.name}"
    if capabilities is None:
        capabilities = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    missing = sorted({c for c in capabilities if not _covers(record["archs"], c)})
    if missing:
        named = ", ".join(f"{major}.{minor}" for major, minor in missing)
        return None, (f"the kernels this install carries are for compute capability {', '.join(record['archs'])}, "
                      f"not {named}")
    return library, ""


def compiler_of(library: Path) -> str:
    """The nvcc that built `library`, as its build file names it, or the wheel it came with."""
    record = library.parent / PREBUILT_RECORD
    if record.exists():
        return f"the wheel's build, against torch {json.loads(record.read_text())['torch']} (stable ABI)"
    ninja = library.parent / "build.ninja"
    found = re.search(r"^nvcc = (.+)$", ninja.read_text(), re.MULTILINE) if ninja.exists() else None
    return found.group(1).strip() if found else "unknown"


def kernel_source(family: str, archs: Sequence[str], capabilities: Sequence[tuple[int, int]]) -> str:
    """Where `family`'s kernels would come from here, in words: the wheel, the cache, or
    neither and why."""
    library, why_not = prebuilt(family, capabilities)
    if library is not None:
        return f"from this install's wheel ({library.name})"
    if not archs:
        return f"none: {why_not}, and no GPU or architecture to build for"
    directory = build_root() / build_name(archs, family)
    if (directory / "build-complete").exists():
        return f"from the build cache ({directory}), compiled with {compiler_of(directory / (directory.name + '.so'))}"
    failures = sorted(directory.glob(FAILURE_RECORD.format(compiler="*")))
    if failures:
        return f"none: a build failed (recorded in {failures[0]}); python -m fusedloss build --force tries again"
    return f"none yet: {why_not}; compiled on first use (or by python -m fusedloss build) into {directory}"


def registered_ops() -> list[str]:
    """The fusedloss:: operators that have a CUDA kernel in this process."""
    return [op for op in OPS if torch._C._dispatch_has_kernel_for_dispatch_key(f"fusedloss::{op}", "CUDA")]


def _families(names: Sequence[str]) -> list[Family]:
    unknown = sorted(set(names) - set(FAMILIES))
    if unknown:
        raise ValueError(f"no kernel family {unknown}: the families are {', '.join(FAMILIES)}")
    return [FAMILIES[name] for name in (names or FAMILIES)]


SIDE_BY_SIDE_FROM_CORES = 8
# The builds that compile beside a child's (_compiling_beside), by name, comma-separated.
_BESIDE_ENV = "FUSEDLOSS_COMPILING_BESIDE"


def _built(archs: Sequence[str], family: Family) -> bool:
    return (build_root() / build_name(archs, family.name) / "build-complete").exists()


@contextmanager
def _compiling_beside(families: Sequence[Family], archs: Sequence[str], force: bool,
                      also_compiling: Sequence[str]) -> Iterator[dict[str, subprocess.Popen]]:
    """Compile `families` each in a child process (``python -m fusedloss build --family``)
    while this one compiles another: two ninja builds keep the cores busy through each
    other's tails. Yields each child by family name; the caller waits for a child before
    it loads that family, which is then cached (or its failure recorded, which the
    caller reports). Each child hears which builds compile beside it (`also_compiling`, and
    the other children), for its estimate. Children still running when the body raises are
    stopped. Below
    SIDE_BY_SIDE_FROM_CORES cores nothing starts: there the builds only contend, and one
    after the other is faster."""
    children: dict[str, subprocess.Popen] = {}
    if _cores() < SIDE_BY_SIDE_FROM_CORES:
        families = ()
    package_root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    starting = [family.name for family in families if force or not _built(archs, family)]
    for name in starting:
        beside = ",".join([*also_compiling, *(other for other in starting if other != name)])
        command = [sys.executable, "-m", "fusedloss", "build", "--family", name, "--arch", ";".join(archs)]
        # its stderr says what it compiles and how long that took; its summary on stdout is this process's to give
        children[name] = subprocess.Popen(command + (["--force"] if force else []), env={**env, _BESIDE_ENV: beside},
                                          stdout=subprocess.DEVNULL)
    try:
        yield children
    except BaseException:
        for child in children.values():
            child.terminate()
        raise
    finally:
        for child in children.values():
            child.wait()


def build(arch: str | None = None, force: bool = False, families: Sequence[str] = (),
          cxx_autograd: bool = True) -> dict[str, Path]:
    """Build `families` (default: all) for `arch` (else ``TORCH_CUDA_ARCH_LIST``, else the
    visible GPUs) into the cache, or reuse the cached builds; load them; return each
    family's library path. With the plain family, and `cxx_autograd`, also compile and
    load the host-only C++ autograd for this torch (no failure if it cannot be).

    Needs no GPU, so a login node or an image build can prepare the cache that
    later GPU processes load. ``force`` builds again, also after a recorded failure.
    Families that need compiling compile side by side on a host of
    ``SIDE_BY_SIDE_FROM_CORES`` cores or more: the first here, each other one in a
    child process.
    """
    archs = arch_list(arch)
    if not archs:
        raise KernelsUnavailableError("no GPU is visible and no architecture was named: pass --arch (for example "
                                      "python -m fusedloss build --arch 9.0) or set TORCH_CUDA_ARCH_LIST")
    libraries = {}
    chosen = _families(families)
    with_cxx_autograd = cxx_autograd and FAMILIES["plain"] in chosen
    with _load_lock:
        if with_cxx_autograd and force:
            shutil.rmtree(cxx_autograd_library().parent, ignore_errors=True)
        to_compile = []
        for family in chosen:
            library, why_not = prebuilt(family.name, [_capability(a) for a in archs])
            if library is not None and not force:
                libraries[family.name] = _load_library(library, library.parent)
            else:
                to_compile.append((family, why_not))
        builds = sum(force or not _built(archs, family) for family, _ in to_compile)
        if _cores() < SIDE_BY_SIDE_FROM_CORES:  # one after the other (_compiling_beside)
            builds = min(builds, 1)
        # a child's builds beside it, where this process is one: what a parent said, else none
        from_parent = [name for name in os.environ.get(_BESIDE_ENV, "").split(",") if name]
        with _cxx_autograd_compiling(with_cxx_autograd, builds) as autograd_compiling:
            autograd = [_CXX_AUTOGRAD] if autograd_compiling else []
            here = [family.name for family, _ in to_compile[:1] if force or not _built(archs, family)]
            with _compiling_beside([family for family, _ in to_compile[1:]], archs, force,
                                   [*here, *autograd]) as children:
                for family, why_not in to_compile:
                    if family.name in children:
                        children[family.name].wait()  # its library is cached now, or its failure recorded
                    # one after the other, only the first compiles beside the C++ autograd
                    alongside = autograd if children or family is to_compile[0][0] else []
                    beside = [*from_parent, *(name for name in children if name != family.name), *alongside]
                    libraries[family.name] = _build_or_load(family, archs, force and family.name not in children,
                                                            why_not, beside)
        if with_cxx_autograd:
            load_cxx_autograd(build_if_missing=True)
    return libraries


def load(*families: str) -> dict[str, Path]:
    """Build `families` of CUDA kernels (default: all) if needed, load each once per process,
    and return the loaded ones' library paths.

    Without a CUDA device there is nothing to run them on (CUDA tensors can then
    only be fake ones, which the fake kernels serve): nothing is loaded. Raises
    ``KernelsUnavailableError`` when they cannot be built or loaded; a failure
    is remembered, so a build is tried once per process, and on disk, so a
    later process reports it at once.
    """
    for family in _families(families):
        if family.name in _loaded:
            continue
        with _load_lock:
            if family.name in _load_failures:
                raise _load_failures[family.name]
            if family.name not in _loaded and torch.cuda.is_available():
                try:
                    library, why_not = prebuilt(family.name)
                    if library is not None:
                        _loaded[family.name] = _load_library(library, library.parent)
                    else:
                        with _cxx_autograd_compiling(family.name == "plain", builds_beside=1) as autograd:
                            _loaded[family.name] = _build_or_load(family, arch_list(), why=why_not,
                                                                  beside=[_CXX_AUTOGRAD] if autograd else [])
                    # The C++ autograd serves every family's small steps. A source build of the
                    # plain family has a compiler at hand; a wheel's user gets it from `build`.
                    load_cxx_autograd(build_if_missing=library is None and family.name == "plain")
                except KernelsUnavailableError as error:
                    _load_failures[family.name] = error
                    raise
    return dict(_loaded)


# ---- the host-only autograd accelerator -------------------------------------------------

CXX_AUTOGRAD_ENV = "FUSEDLOSS_CXX_AUTOGRAD"
_CXX_AUTOGRAD_SOURCE = CSRC / "cxx_autograd.cpp"
_cxx_autograd_loaded = False


def cxx_autograd_loaded() -> bool:
    """Whether the C++ autograd of the small-step paths serves this process (``routing``)."""
    return _cxx_autograd_loaded


def _cxx_autograd_flags() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    # The standard torch's own cpp_extension asks for: C++20 from torch 2.13 on.
    standard = "-std=c++20" if _version(torch.__version__) >= (2, 13) else "-std=c++17"
    # -O1: the header parse dominates, and this host code does little work.
    # AT_PER_OPERATOR_HEADERS: libtorch's headers then include the few operators they use,
    # not ATen/Functions.h with every operator.
    return [standard, "-O1", "-DAT_PER_OPERATOR_HEADERS", "-shared", "-fPIC", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *(f"-I{path}" for path in include_paths())]


def cxx_autograd_library() -> Path:
    """Where the accelerator for this torch is cached: its C++ API is this torch's own."""
    fingerprint = "\0".join([_CXX_AUTOGRAD_SOURCE.read_text(), torch.__version__, torch.version.git_version,
                             sys.version.split()[0]])
    name = "fusedloss_cxx_autograd_" + hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
    return build_root() / name / f"{name}.so"


def _compile_cxx_autograd(library: Path, builds_beside: int) -> None:
    compiler = os.environ.get("CXX") or "c++"
    torch_lib = Path(torch.__file__).parent / "lib"
    partial = library.with_suffix(".partial.so")
    command = [compiler, *_cxx_autograd_flags(), str(_CXX_AUTOGRAD_SOURCE), "-o", str(partial), f"-L{torch_lib}",
               "-lc10", "-ltorch_cpu"]
    _say(f"compiling the C++ autograd for torch {torch.__version__} with {compiler}, once; "
         f"about {_expected_cxx_autograd_seconds(builds_beside)} s here; cached in "
         f"{library.parent}")
    start = time.perf_counter()
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except OSError as error:
        raise KernelsUnavailableError(f"{compiler} could not be run: {error}") from error
    if result.returncode != 0:
        raise KernelsUnavailableError(f"{compiler} failed:\n  {_first_error_lines(result.stderr + result.stdout)}")
    partial.replace(library)
    _say(f"compiled the C++ autograd in {time.perf_counter() - start:.0f} s")


def _compiled_cxx_autograd(build_if_missing: bool, builds_beside: int = 0) -> Path | None:
    """The accelerator's library for this torch, compiled first if missing and
    `build_if_missing` (beside `builds_beside` ninja builds); None where it is not there (a
    failed compile is recorded and said once)."""
    library = cxx_autograd_library()
    record = library.parent / "build-failed.txt"
    if not library.exists():
        if not build_if_missing or record.exists():
            return None
        library.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive(library.parent / "build.flock"):
            if not library.exists():
                try:
                    _compile_cxx_autograd(library, builds_beside)
                except KernelsUnavailableError as error:
                    record.write_text(f"{error}\n")
                    _say(f"the optional C++ autograd did not compile ({error}); the Python autograd serves, "
                         f"with the same results. Recorded in {record}.")
                    return None
    return library


@contextmanager
def _cxx_autograd_compiling(wanted: bool, builds_beside: int) -> Iterator[bool]:
    """Compile the accelerator, where `wanted` and missing, in a thread while the body builds
    the kernels (`builds_beside` ninja builds): a host compile beside nvcc's, so a source
    build's wall time is the longer of the two, not their sum. Yields whether it compiles.
    Loading it stays with the caller, after the kernels' operators exist."""
    worker = None
    if (wanted and not _cxx_autograd_loaded and os.environ.get(CXX_AUTOGRAD_ENV, "1") != "0"
            and not cxx_autograd_library().exists()):
        def compile_quietly() -> None:
            try:
                _compiled_cxx_autograd(build_if_missing=True, builds_beside=builds_beside)
            except Exception:  # the caller's load_cxx_autograd meets it again and reports it
                pass
        worker = threading.Thread(target=compile_quietly, name="fusedloss-cxx-autograd", daemon=True)
        worker.start()
    try:
        yield worker is not None
    finally:
        if worker is not None:
            worker.join()


def load_cxx_autograd(build_if_missing: bool) -> bool:
    """Load the accelerator for this torch where it is cached, else compile it first if
    `build_if_missing`; return whether it serves. A failed compile is recorded and said
    once, and the Python autograd serves."""
    global _cxx_autograd_loaded
    if _cxx_autograd_loaded or os.environ.get(CXX_AUTOGRAD_ENV, "1") == "0":
        return _cxx_autograd_loaded
    library = _compiled_cxx_autograd(build_if_missing)
    if library is None:
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError as error:
        _say(f"loading {library} failed ({error}); the Python autograd serves. Delete {library.parent} to rebuild it.")
        return False
    _cxx_autograd_loaded = True
    return True


def _kernels_required() -> bool:
    return os.environ.get(REQUIRE_KERNELS_ENV, "0") not in ("", "0")


def user_stacklevel() -> int:
    """The stacklevel of the first frame outside fusedloss, for a warning issued by the
    caller: so that it points at the user's call, however deep the package's path is."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "fusedloss":
        frame, level = frame.f_back, level + 1
    return level


def kernels_loaded(family: str = "plain") -> bool:
    """Whether `family`'s kernels are loaded in this process (the plain family's load also
    loads the C++ autograd, where it is built)."""
    return family in _loaded


def use_kernels(family: str = "plain") -> bool:
    """Whether CUDA operands go to the `family` of fusedloss's kernels (loading them on first call).

    False when the kernels cannot be built or loaded: the first such call warns
    with a ``FallbackWarning`` saying why and how to fix it, unless
    ``FUSEDLOSS_REQUIRE_KERNELS=1``, which raises ``KernelsUnavailableError`` instead.
    """
    global _fallback_warned
    if family in _loaded:
        return True
    try:
        load(family)
    except KernelsUnavailableError as error:
        if _kernels_required():
            raise
        if not _fallback_warned:
            _fallback_warned = True
            warnings.warn(
                f"fusedloss: {error}\nfusedloss falls back to torch.nn.functional: results stay correct, "
                f"but without the fused kernels. Set {REQUIRE_KERNELS_ENV}=1 to make this an error.",
                FallbackWarning,
                stacklevel=user_stacklevel(),
            )
        return False
    return True


# torch.compile calls this once while tracing and keeps the answer, as
# torch.compiler.assume_constant_result(use_kernels) would; set directly, as that
# decorator does, because importing it costs the import of torch._dynamo.
use_kernels._dynamo_marked_constant = True  # type: ignore[attr-defined]
