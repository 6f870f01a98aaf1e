"""Compiling and loading the CUDA kernels.

The sources in ``csrc/`` are read (local ``#include``s pasted in) and compiled
on first use with ``torch.utils.cpp_extension.load_inline`` for the compute
capabilities of the visible GPUs. The build goes into
``$TORCH_EXTENSIONS_DIR/fusedloss_<hash>`` (torch's default root when unset);
the hash covers the sources, the flags and the torch, CUDA and Python versions,
so a build is reused by every later process and never by a different setup.

Processes that start together take an ``flock`` on the build directory: one
builds, the others wait and then load its library. The kernel drops the lock
of a process that dies, so a killed build cannot leave the others waiting.

When the kernels cannot be built or loaded (no nvcc, no ninja, a compile
error, a GPU the toolkit does not support), ``use_kernels()`` warns once with
the cause and the fix and returns False, and ``fusedloss.functional`` falls
back to ``torch.nn.functional``. ``FUSEDLOSS_REQUIRE_KERNELS=1`` makes that an
error instead.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
_LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)"[ \t]*$', re.MULTILINE)
_COMMON_FLAGS = ["-O3", "-std=c++17"]

REQUIRE_KERNELS_ENV = "FUSEDLOSS_REQUIRE_KERNELS"

_loaded_library: Path | None = None
_load_failure: KernelsUnavailableError | None = None
_fallback_warned = False
_load_lock = threading.Lock()


class KernelsUnavailableError(RuntimeError):
    """The CUDA kernels could not be built or loaded; the message says why and how to fix it."""


class FallbackWarning(UserWarning):
    """fusedloss runs torch.nn.functional's losses because its kernels are unavailable."""


def read_source(name: str, _seen: set[str] | None = None) -> str:
    """``csrc/name`` with each local ``#include "..."`` replaced by that file's text, once."""
    seen = set() if _seen is None else _seen
    seen.add(name)

    def paste(match: re.Match) -> str:
        header = match.group(1)
        return "" if header in seen else read_source(header, seen)

    text = (CSRC / name).read_text()
    return _LOCAL_INCLUDE.sub(paste, text.replace("#pragma once\n", ""))


def arch_flags() -> list[str]:
    """One ``-gencode`` per distinct compute capability among the visible GPUs."""
    capabilities = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return [f"-gencode=arch=compute_{a}{b},code=sm_{a}{b}" for a, b in capabilities]


def _build_inputs() -> tuple[str, str, str, list[str]]:
    cpp = read_source("fusedloss_ops.cpp")
    cuda = read_source("loss_kernels.cu")
    cuda_flags = _COMMON_FLAGS + arch_flags()
    fingerprint = "\0".join(
        [cpp, cuda, *cuda_flags, torch.__version__, str(torch.version.cuda), sys.version.split()[0]]
    )
    name = "fusedloss_" + hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
    return name, cpp, cuda, cuda_flags


def build_root() -> Path:
    """Where builds go: ``$TORCH_EXTENSIONS_DIR``, else torch's default root."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        from torch.utils.cpp_extension import get_default_build_root

        root = get_default_build_root()
    return Path(root)


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _nvcc() -> str:
    from torch.utils import cpp_extension

    cuda_home = cpp_extension.CUDA_HOME
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else None
    if nvcc is None or not os.path.exists(nvcc):
        where = f"CUDA_HOME={cuda_home}" if cuda_home else "CUDA_HOME is unset and nvcc is not on PATH"
        raise KernelsUnavailableError(
            f"nvcc was not found ({where}). Install the CUDA toolkit {torch.version.cuda} and set CUDA_HOME "
            "to its root."
        )
    return nvcc


def _check_build_tools() -> None:
    """Fail early, with the fix, for what the build would otherwise fail on obscurely."""
    from torch.utils import cpp_extension

    nvcc = _nvcc()
    if not cpp_extension.is_ninja_available():
        raise KernelsUnavailableError("ninja was not found. Install it: pip install ninja")
    listed = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True)
    if listed.returncode != 0:
        return  # an old nvcc without the flag: the build itself will tell
    supported = set(listed.stdout.split())
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        if f"compute_{major}{minor}" not in supported:
            raise KernelsUnavailableError(
                f"cuda:{index} has compute capability {major}.{minor}, which {nvcc} cannot compile for "
                f"(it supports {', '.join(sorted(supported))}). Install a CUDA toolkit that supports it, "
                "or hide that GPU with CUDA_VISIBLE_DEVICES."
            )


def _first_error_lines(message: str, count: int = 3) -> str:
    # Compiler diagnostics ("x.cu(12): error: ...", "fatal error: ..."), not the command lines.
    errors = [line.strip() for line in message.splitlines() if "error:" in line]
    return "\n  ".join(errors[:count] or message.strip().splitlines()[-count:])


def _build_or_load() -> Path:
    from torch.utils.cpp_extension import load_inline

    name, cpp, cuda, cuda_flags = _build_inputs()
    directory = build_root() / name
    library = directory / f"{name}.so"
    done = directory / "build-complete"
    directory.mkdir(parents=True, exist_ok=True)
    if not done.exists():
        with _exclusive(directory / "build.flock"):
            if not done.exists():
                _check_build_tools()
                # A baton file of torch's own, left by a build that was killed.
                (directory / "lock").unlink(missing_ok=True)
                try:
                    load_inline(
                        name=name,
                        cpp_sources=cpp,
                        cuda_sources=cuda,
                        extra_cflags=_COMMON_FLAGS,
                        extra_cuda_cflags=cuda_flags,
                        build_directory=str(directory),
                        is_python_module=False,
                    )
                except Exception as error:
                    raise KernelsUnavailableError(
                        f"compiling the CUDA kernels in {directory} failed:\n  {_first_error_lines(str(error))}\n"
                        "Check that nvcc, the C++ compiler and torch fit together (torch "
                        f"{torch.__version__} was built with CUDA {torch.version.cuda}), and report the "
                        "error to fusedloss if they do."
                    ) from error
                done.touch()
                return library
    try:
        torch.ops.load_library(str(library))
    except OSError as error:
        raise KernelsUnavailableError(
            f"loading {library} failed ({error}). Delete {directory} to rebuild it."
        ) from error
    return library


def load() -> Path | None:
    """Build the CUDA kernels if needed, load them once per process, and return the library's path.

    Without a CUDA device there is nothing to run them on (CUDA tensors can then
    only be fake ones, which the fake kernels serve): None. Raises
    ``KernelsUnavailableError`` when they cannot be built or loaded; a failure
    is remembered, so the build is tried once per process.
    """
    global _loaded_library, _load_failure
    if _loaded_library is None:
        with _load_lock:
            if _load_failure is not None:
                raise _load_failure
            if _loaded_library is None and torch.cuda.is_available():
                try:
                    _loaded_library = _build_or_load()
                except KernelsUnavailableError as error:
                    _load_failure = error
                    raise
    return _loaded_library


def _kernels_required() -> bool:
    return os.environ.get(REQUIRE_KERNELS_ENV, "0") not in ("", "0")


def use_kernels() -> bool:
    """Whether CUDA operands go to fusedloss's kernels (loading them on first call).

    False when the kernels cannot be built or loaded: the first such call warns
    with a ``FallbackWarning`` saying why and how to fix it, unless
    ``FUSEDLOSS_REQUIRE_KERNELS=1``, which raises ``KernelsUnavailableError`` instead.
    """
    global _fallback_warned
    try:
        load()
    except KernelsUnavailableError as error:
        if _kernels_required():
            raise
        if not _fallback_warned:
            _fallback_warned = True
            warnings.warn(
                f"fusedloss: {error}\nfusedloss falls back to torch.nn.functional: results stay correct, "
                f"but without the fused kernels. Set {REQUIRE_KERNELS_ENV}=1 to make this an error.",
                FallbackWarning,
                stacklevel=4,
            )
        return False
    return True


# torch.compile calls this once while tracing and keeps the answer, as
# torch.compiler.assume_constant_result(use_kernels) would; set directly, as that
# decorator does, because importing it costs the import of torch._dynamo (~1.3 s).
use_kernels._dynamo_marked_constant = True  # type: ignore[attr-defined]
