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
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
_LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)"[ \t]*$', re.MULTILINE)
_COMMON_FLAGS = ["-O3", "-std=c++17"]

_loaded_library: Path | None = None
_load_lock = threading.Lock()


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
                # A baton file of torch's own, left by a build that was killed.
                (directory / "lock").unlink(missing_ok=True)
                load_inline(
                    name=name,
                    cpp_sources=cpp,
                    cuda_sources=cuda,
                    extra_cflags=_COMMON_FLAGS,
                    extra_cuda_cflags=cuda_flags,
                    build_directory=str(directory),
                    is_python_module=False,
                )
                done.touch()
                return library
    torch.ops.load_library(str(library))
    return library


def load() -> Path | None:
    """Build the CUDA kernels if needed, load them once per process, and return the library's path.

    Without a CUDA device there is nothing to run them on (CUDA tensors can then
    only be fake ones, which the fake kernels serve): None.
    """
    global _loaded_library
    if _loaded_library is None:
        with _load_lock:
            if _loaded_library is None and torch.cuda.is_available():
                _loaded_library = _build_or_load()
    return _loaded_library
