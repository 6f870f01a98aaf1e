"""A wheel that carries the compiled kernels, where the build can compile them.

``python -m build --wheel --no-isolation`` (or ``pip wheel --no-build-isolation .``),
run where a CUDA build of torch and a CUDA compiler are installed, compiles each
family of ``csrc/`` (``fusedloss.build.FAMILIES``) into
``fusedloss/_<family>_kernels.abi3.so`` for ``TORCH_CUDA_ARCH_LIST`` (default:
every architecture fusedloss supports, and PTX of the newest) and records what
they were built against in ``fusedloss/_kernels.json``. Their host code uses only
PyTorch's stable ABI and no Python API, so the wheel is tagged for every CPython
from 3.10 (abi3) and loads on every torch of its CUDA major from
``fusedloss.build.STABLE_ABI_FLOOR`` up (``fusedloss.build.prebuilt``); elsewhere
fusedloss compiles from source on first use. Everywhere else (an sdist, an
isolated build, a CPU build of torch, no CUDA compiler, ``FUSEDLOSS_WHEEL_KERNELS=0``)
the wheel is pure Python.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
DEFAULT_ARCHS = "8.0;8.6;8.9;9.0;10.0;12.0+PTX"


def _build_module():
    """fusedloss/build.py alone: the package's __init__ would define its operators here."""
    spec = importlib.util.spec_from_file_location("_fusedloss_build", ROOT / "src" / "fusedloss" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _kernel_build():
    """(ext_modules, cmdclass) for a wheel with the kernels, or nothing for a pure one."""
    if os.environ.get("FUSEDLOSS_WHEEL_KERNELS", "1") == "0":
        return [], {}
    try:
        import torch
    except ImportError:  # an isolated build, or an sdist
        return [], {}
    if not torch.version.cuda:
        print("fusedloss: torch is a CPU build, so the wheel carries no kernels", file=sys.stderr)
        return [], {}
    build = _build_module()
    try:
        toolkit = build.find_toolkit()
    except build.KernelsUnavailableError as error:
        print(f"fusedloss: the wheel carries no kernels, which compile on first use instead: {error}", file=sys.stderr)
        return [], {}
    archs = build.arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_ARCHS)
    # cpp_extension takes the toolkit from CUDA_HOME when it is first imported.
    os.environ["CUDA_HOME"] = str(toolkit.home)
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    link_dir = ROOT / "build" / "cudart"
    link_dir.mkdir(parents=True, exist_ok=True)
    extensions = {
        family.name: CUDAExtension(
            f"fusedloss._{family.name}_kernels",
            sources=[str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
                     for path in build.shard_sources(family, ROOT / "build" / "shards" / family.name)],
            include_dirs=[str(build.CSRC)],
            extra_compile_args={"cxx": build.COMMON_FLAGS, "nvcc": build.CUDA_FLAGS + build.gencode_flags(archs)},
            # The pip runtime has only libcudart.so.<major>, which torch has loaded by then: no rpath.
            extra_link_args=[arg for arg in build.cudart_link_flags(toolkit, link_dir) if "-rpath" not in arg],
            py_limited_api=True,  # no Python API: links no libtorch_python
        )
        for family in build.FAMILIES.values()
    }

    class BuildKernels(BuildExtension):
        """Builds the libraries, and records beside them what they were built against."""

        def run(self) -> None:
            super().run()
            paths = {family: Path(self.get_ext_fullpath(extension.name)) for family, extension in extensions.items()}
            record = {"torch": torch.__version__, "stable_abi_floor": list(build.STABLE_ABI_FLOOR),
                      "cuda": torch.version.cuda, "archs": archs,
                      "libraries": {family: path.name for family, path in paths.items()}}
            package = paths["plain"].parent
            (package / build.PREBUILT_RECORD).write_text(json.dumps(record, indent=1) + "\n")

    print(f"fusedloss: the wheel carries the kernels for {', '.join(archs)}, built against torch "
          f"{torch.__version__} with {toolkit.nvcc}, for every torch from "
          f"{'.'.join(map(str, build.STABLE_ABI_FLOOR))} of CUDA {torch.version.cuda.split('.')[0]}", file=sys.stderr)
    return list(extensions.values()), {"build_ext": BuildKernels.with_options(use_ninja=True)}


ext_modules, cmdclass = _kernel_build()
# Tagged cp310-abi3 where it carries kernels: their libraries use no Python API.
options = {"bdist_wheel": {"py_limited_api": "cp310"}} if ext_modules else {}
setup(ext_modules=ext_modules, cmdclass=cmdclass, options=options)
