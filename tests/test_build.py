"""The build: sources, names, the compiler, remembered failures, and the command line.

The compiler is a stand-in here (the real build runs in CI through
``scripts/ci_build.sh`` and on the GPU machine).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fusedloss import build

SRC = Path(__file__).resolve().parents[1] / "src"


def test_the_build_compiles_the_real_files_of_the_package():
    names = {p.name for p in build.CSRC.iterdir()}
    sources = [source for family in build.FAMILIES.values() for source in family.sources]
    assert set(sources) <= names and len(sources) == len(set(sources))
    # Every .cu file belongs to exactly one family; each family has a host file of its own.
    assert sorted(s for s in sources if s.endswith(".cu")) == sorted(n for n in names if n.endswith(".cu"))
    assert all(family.host_source.endswith(".cpp") for family in build.FAMILIES.values())
    assert set(build.OPS) == {op for family in build.FAMILIES.values() for op in family.ops}
    # Every header a source includes ships with it.
    for path in build.CSRC.iterdir():
        for header in re.findall(r'^#include "([^"]+)"', path.read_text(), re.MULTILINE):
            assert header in names, f"{path.name} includes {header}, which the package does not ship"


def test_each_cu_file_is_compiled_once_per_shard(tmp_path):
    family = build.FAMILIES["plain"]
    sources = build.shard_sources(family, tmp_path)
    assert sources[0] == build.CSRC / family.host_source
    assert len(sources) == 1 + len(family.cuda_sources) * len(build.SHARDS)
    text = (tmp_path / "reduced_loss.float16.cu").read_text()
    assert "#define FUSEDLOSS_SHARD shard_float16" in text and "#define FUSEDLOSS_SHARD_INPUT __half" in text
    assert text.endswith('#include "reduced_loss.cu"\n')
    # The host code dispatches every launcher its library calls to the shards.
    for family in build.FAMILIES.values():
        host = (build.CSRC / family.host_source).read_text()
        called = set(re.findall(r"\b((?:launch_\w+|\w+_scratch_bytes|\w+_partials))\(", host)) - {"launch_bounds"}
        dispatched = set(re.findall(r"FUSEDLOSS_SHARD_DISPATCH\(\w+, (\w+),", host))
        assert called <= dispatched, called - dispatched


def test_the_host_code_targets_the_stable_abi():
    for flags in (build.COMMON_FLAGS, build.CUDA_FLAGS):
        assert any(flag.startswith("-DTORCH_TARGET_VERSION=0x020a") for flag in flags)
    # The optional C++ autograd is the one exception: compiled per torch, outside the families.
    assert all(build._CXX_AUTOGRAD_SOURCE.name not in family.sources for family in build.FAMILIES.values())
    for path in build.CSRC.iterdir():
        if path.suffix in (".cpp", ".h", ".cuh", ".cu") and path != build._CXX_AUTOGRAD_SOURCE:
            includes = re.findall(r'^#include <([^>]+)>', path.read_text(), re.MULTILINE)
            torch_headers = [h for h in includes if h.startswith(("torch/", "ATen/", "c10/"))]
            assert all(h.startswith(("torch/csrc/stable/", "torch/csrc/inductor/aoti_torch/c/", "torch/headeronly/"))
                       for h in torch_headers), (path.name, torch_headers)


def test_no_flag_fixes_the_cpp_standard():
    # torch's cpp_extension picks the standard its headers need (C++20 from torch 2.14 on).
    assert not any(flag.startswith("-std") for flag in build.COMMON_FLAGS + build.CUDA_FLAGS)


def test_the_tables_of_losses_agree_across_the_language_boundary():
    from fusedloss.losses import LOSSES

    table = (build.CSRC / "losses.cuh").read_text()
    cuda_names = re.findall(r'^\s*X\(\w+, "(\w+)", "\w*", \w+\)', table, re.MULTILINE)
    assert cuda_names == list(LOSSES)
    rows = re.findall(r'^\s*X\((\w+), "(\w+)", "(\w*)", (\w+)\)', table, re.MULTILINE)
    for struct, name, param, domain in rows:
        assert f"struct {struct}Loss {{" in table
        assert (param or None) == LOSSES[name].param, name
        # the param's domain: > 0 (0 is another loss's, as Smooth L1's beta = 0 is L1), or [0, 1]
        unit = domain == "kUnitInterval"
        assert (LOSSES[name].param_max, LOSSES[name].param_zero_valid) == ((1.0, True) if unit else (math.inf, False))
        # The dtype rules live in both tables: the result in the input's dtype (Huber's),
        # each gradient in its operand's dtype (Smooth L1's), and the param rounded into the
        # loss's dtype as PyTorch rounds beta and delta (fusedloss's own losses keep it in
        # at least float32, as their formulas do).
        body = table.split(f"struct {struct}Loss {{", 1)[1].split("\n};", 1)[0]
        for flag, field in (("kOutputHasInputDtype", "keeps_input_dtype"), ("kGradInOwnDtype", "gradient_in_own_dtype"),
                            ("kParamInLossDtype", "pytorch")):
            value = re.search(flag + r" = (true|false);", body).group(1) == "true"
            assert value == getattr(LOSSES[name], field), (name, flag)


def test_build_root_honours_torch_extensions_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build.build_root() == tmp_path
    # torch's default otherwise, found in a fresh process that has not imported cpp_extension
    code = ("from fusedloss import build; import torch.utils.cpp_extension as c; "
            "print(build.build_root() == build.Path(c.get_default_build_root()))")
    env = {key: value for key, value in os.environ.items() if key != "TORCH_EXTENSIONS_DIR"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(env, PYTHONPATH=str(SRC)), timeout=120)
    assert done.stdout.strip() == "True", done.stderr


# ---- architectures: a build made without a GPU is the one a GPU process loads ----------


def test_arch_list_from_argument_environment_or_devices(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    assert build.arch_list() == ["9.0"]
    assert build.arch_list("9.0") == ["9.0"]
    assert build.arch_list("9.0;8.0 8.0") == ["8.0", "9.0"]
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6+PTX;9.0")
    assert build.arch_list() == ["8.6+PTX", "9.0"]
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    assert build.arch_list() == ["9.0a"] and build.gencode_flags(["9.0a"]) == ["-gencode=arch=compute_90a,code=sm_90a"]
    assert build.arch_list("9.0") == ["9.0"]  # the argument wins
    with pytest.raises(ValueError, match="not a compute capability"):
        build.arch_list("sm_90")


def test_gencode_flags():
    assert build.gencode_flags(["9.0"]) == ["-gencode=arch=compute_90,code=sm_90"]
    assert build.gencode_flags(["8.6+PTX"]) == ["-gencode=arch=compute_86,code=sm_86",
                                                "-gencode=arch=compute_86,code=compute_86"]


def test_prebuilt_name_matches_the_gpu_process(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    assert build.build_name(build.arch_list("9.0")) == build.build_name(build.arch_list())
    assert build.build_name(["9.0"]) != build.build_name(["8.0"])


def test_the_name_covers_the_sources(monkeypatch, tmp_path):
    before = build.build_name(["9.0"])
    for path in build.CSRC.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    (tmp_path / "losses.cuh").write_text((tmp_path / "losses.cuh").read_text() + "\n// changed\n")
    monkeypatch.setattr(build, "CSRC", tmp_path)
    assert build.build_name(["9.0"]) != before


# ---- finding the compiler ------------------------------------------------------------------


def _fake_executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def no_system_toolkit(monkeypatch, tmp_path):
    """Only what the test lays out under tmp_path/site-packages is there to be found."""
    monkeypatch.setattr(build, "_system_cuda_homes", lambda: [])
    monkeypatch.setattr(build, "_pip_package_dirs", lambda: [tmp_path / "site-packages" / "nvidia"])
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    return tmp_path / "site-packages" / "nvidia"


def test_pip_compiler_of_torchs_cuda_major_is_found(no_system_toolkit):
    nvidia = no_system_toolkit
    _fake_executable(nvidia / "cu12" / "bin" / "nvcc")  # another major: not this torch's
    _fake_executable(nvidia / "cuda_nvcc" / "bin" / "ptxas")  # what CUDA 12's wheels hold
    with pytest.raises(build.KernelsUnavailableError, match="nvcc was not found"):
        build.find_toolkit()
    _fake_executable(nvidia / "cu13" / "bin" / "nvcc")
    toolkit = build.find_toolkit()
    assert toolkit.origin == "pip" and toolkit.home == nvidia / "cu13" and toolkit.runtime_dir == nvidia / "cu13" / "lib"


def test_missing_compiler_names_the_exact_pip_command(no_system_toolkit, monkeypatch):
    with pytest.raises(build.KernelsUnavailableError) as caught:
        build.find_toolkit()
    assert build.toolkit_install_command() in str(caught.value)
    assert build.toolkit_install_command() == (
        'pip install "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-crt==13.0.*" "nvidia-nvvm==13.0.*" '
        '"nvidia-cuda-cccl==13.0.*"')
    # CUDA 12's pip packages hold ptxas but no nvcc.
    monkeypatch.setattr(torch.version, "cuda", "12.1")
    assert build.toolkit_install_command() == "the CUDA toolkit 12.1 from NVIDIA, with CUDA_HOME set to its folder"


def test_a_system_toolkit_comes_first(no_system_toolkit, monkeypatch, tmp_path):
    _fake_executable(no_system_toolkit / "cu13" / "bin" / "nvcc")
    system = tmp_path / "cuda"
    _fake_executable(system / "bin" / "nvcc")
    (system / "include").mkdir()
    (system / "include" / "cuda_runtime.h").write_text("")
    monkeypatch.setattr(build, "_system_cuda_homes", lambda: [system])
    assert build.find_toolkit() == build.Toolkit(system, "system")


def test_cuda_home_alone_is_searched_when_set(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "mine"))
    assert build._system_cuda_homes() == [tmp_path / "mine"]
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.delenv("CUDA_PATH", raising=False)
    assert build._system_cuda_homes()[-1] == Path("/usr/local/cuda")


def test_the_pip_runtime_is_linked_through_its_versioned_library(tmp_path):
    runtime = tmp_path / "lib"
    runtime.mkdir()
    (runtime / "libcudart.so.13").write_text("")
    (tmp_path / "build").mkdir()
    flags = build.cudart_link_flags(build.Toolkit(tmp_path, "pip", runtime_dir=runtime), tmp_path / "build")
    link = tmp_path / "build" / "cudart" / "libcudart.so"
    assert link.resolve() == (runtime / "libcudart.so.13").resolve()
    assert flags == [f"-L{link.parent}", f"-Wl,-rpath,{runtime}"]


# ---- building once, remembering failures ----------------------------------------------------

# A process that "builds" with a stand-in for the compile step: it logs the build,
# leaves torch's baton file as a real build does while it runs, takes
# BUILD_SECONDS, and writes the library, or fails with a compiler error when
# BUILD_FAILS is set.
_FAKE_BUILDER = """
import os, sys, time
import torch
from fusedloss import build

# The interpreter stands in for nvcc: a failure record is keyed by the compiler file.
build.Toolkit.nvcc = property(lambda self: build.Path(sys.executable).resolve())

def fake_compile(name, directory, toolkit, archs, family):
    with open(os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "builds.log"), "a") as log:
        log.write(name + "\\n")
    open(os.path.join(directory, "lock"), "w").close()
    time.sleep(float(os.environ["BUILD_SECONDS"]))
    os.remove(os.path.join(directory, "lock"))
    if os.environ.get("BUILD_FAILS"):
        raise RuntimeError("Error building extension:\\nreduced_loss.cu(12): error: identifier broken is undefined")
    open(os.path.join(directory, name + ".so"), "w").close()

build._compile = fake_compile
build._load_library = lambda library, directory: library
build._check_build_tools = lambda toolkit, archs: None
build.find_toolkit = lambda: build.Toolkit(build.Path(sys.executable).resolve().parent.parent, "system")
try:
    print(build.build("9.0", force=bool(os.environ.get("FORCE")), families=["plain"], cxx_autograd=False)["plain"])
except build.KernelsUnavailableError as error:
    print("FAILED", error)
"""


def _start_builder(tmp_path, seconds, fails=False, force=False):
    env = dict(os.environ, PYTHONPATH=str(SRC), TORCH_EXTENSIONS_DIR=str(tmp_path), BUILD_SECONDS=str(seconds),
               BUILD_FAILS="1" if fails else "", FORCE="1" if force else "")
    return subprocess.Popen([sys.executable, "-c", _FAKE_BUILDER], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _run_builder(tmp_path, seconds=0.1, fails=False, force=False) -> str:
    out, err = _start_builder(tmp_path, seconds, fails, force).communicate(timeout=120)
    assert "Traceback" not in err, err
    return out


def _build_log(tmp_path):
    log = tmp_path / "builds.log"
    return log.read_text().splitlines() if log.exists() else []


def test_processes_starting_together_build_once(tmp_path):
    processes = [_start_builder(tmp_path, 1.0) for _ in range(8)]
    outputs = [p.communicate(timeout=120) for p in processes]
    assert all(p.returncode == 0 for p in processes), [err for _, err in outputs]
    assert len({out.splitlines()[0] for out, _ in outputs}) == 1
    assert len(_build_log(tmp_path)) == 1


def test_a_killed_build_does_not_block_the_next_process(tmp_path):
    first = _start_builder(tmp_path, 60.0)
    deadline = time.monotonic() + 60
    while not _build_log(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    first.kill()  # SIGKILL mid-build: torch's baton file stays behind
    first.wait()
    assert list(tmp_path.glob("*/lock"))
    out = _run_builder(tmp_path)
    assert len(_build_log(tmp_path)) == 2 and out.splitlines()[0].endswith(".so")


def test_a_build_says_what_it_compiles_and_how_long_it_took(tmp_path):
    out, err = _start_builder(tmp_path, 0.1).communicate(timeout=120)
    before, after = [line for line in err.splitlines() if line.startswith("fusedloss: ")]
    assert before.startswith("fusedloss: this install carries no compiled kernels: compiling the plain CUDA kernels "
                             "for sm_90 with ") and " s here; cached in " in before
    assert str(tmp_path) in before
    assert re.fullmatch(r"fusedloss: compiled the plain CUDA kernels in \d+ s", after)
    # A later process loads the cached build and says nothing.
    out, err = _start_builder(tmp_path, 0.1).communicate(timeout=120)
    assert "fusedloss:" not in err


def test_a_failed_build_is_remembered_until_forced(tmp_path):
    first = _run_builder(tmp_path, fails=True)
    assert first.startswith("FAILED") and "identifier broken is undefined" in first
    assert len(list(tmp_path.glob("*/build-failed-*.txt"))) == 1

    # A later process reports the recorded error at once, without compiling.
    second = _run_builder(tmp_path, seconds=30, fails=True)
    assert second.startswith("FAILED an earlier build") and "identifier broken is undefined" in second
    assert "python -m fusedloss build --force" in second
    assert len(_build_log(tmp_path)) == 1

    # --force compiles again; a success clears the record.
    third = _run_builder(tmp_path, force=True)
    assert third.splitlines()[0].endswith(".so")
    assert len(_build_log(tmp_path)) == 2 and not list(tmp_path.glob("*/build-failed-*.txt"))


def test_a_failure_record_is_keyed_by_the_compiler(tmp_path, monkeypatch):
    first = build.Toolkit(_fake_executable(tmp_path / "a" / "bin" / "nvcc").parent.parent, "system")
    second = build.Toolkit(_fake_executable(tmp_path / "b" / "bin" / "nvcc").parent.parent, "pip")
    assert first.identity() != second.identity()
    monkeypatch.setenv("CXX", "/usr/bin/true")
    with_true = first.identity()
    monkeypatch.setenv("CXX", "/bin/sh")  # the host compiler is part of it
    assert first.identity() != with_true


# ---- the command line -------------------------------------------------------------------


def _cli(*args, **env):
    return subprocess.run([sys.executable, "-m", "fusedloss", *args], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(SRC), **env), timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_bench_without_gpu_says_so_and_exits_0():
    result = _cli("bench")
    assert result.returncode == 0, result.stderr
    first, *rest = result.stdout.splitlines()
    assert "no CUDA device" in first and "torch.nn.functional" in first
    assert any(line.startswith("mse") for line in rest)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_build_without_gpu_or_arch_says_what_to_pass(tmp_path):
    result = _cli("build", TORCH_EXTENSIONS_DIR=str(tmp_path), TORCH_CUDA_ARCH_LIST="")
    assert result.returncode == 1
    assert "pass --arch" in result.stderr or "built without CUDA" in result.stderr


# ---- the kernels a wheel carries ------------------------------------------------------------


@pytest.fixture
def carried(monkeypatch, tmp_path):
    """A stand-in for an install whose wheel carries kernels: build.py's folder, with a record."""
    package = tmp_path / "fusedloss"
    package.mkdir()
    monkeypatch.setattr(build, "__file__", str(package / "build.py"))

    def write(torch_version="2.14.1+cu130", archs=("8.0", "9.0", "12.0+PTX"), cuda="13.0"):
        libraries = {family: f"_{family}_kernels.abi3.so" for family in build.FAMILIES}
        for library in libraries.values():
            (package / library).write_bytes(b"")
        record = {"torch": torch_version, "stable_abi_floor": list(build.STABLE_ABI_FLOOR), "cuda": cuda,
                  "archs": list(archs), "libraries": libraries}
        (package / build.PREBUILT_RECORD).write_text(json.dumps(record))
        return {family: package / library for family, library in libraries.items()}

    return write


def test_a_source_install_carries_no_kernels(carried):
    assert build.prebuilt("plain", [(9, 0)]) == (None, "this install carries no compiled kernels")


def test_carried_kernels_fit_their_architectures(carried, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    libraries = carried()
    for capability in [(8, 0), (8, 6), (8, 9), (9, 0), (12, 0), (12, 1)]:  # same major, or PTX at most its own
        for family, library in libraries.items():
            assert build.prebuilt(family, [capability]) == (library, ""), capability
    for capability in [(7, 5), (10, 0)]:  # older than any; sm_90 machine code does not run on sm_100
        found, why = build.prebuilt("plain", [(9, 0), capability])
        assert found is None and f"not {capability[0]}.{capability[1]}" in why


@pytest.mark.parametrize("version", ["2.10.0+cu130", "2.11.0", "2.13.0+cu130", "2.14.1", "2.20.0a0+git1234"])
def test_carried_kernels_load_on_every_torch_from_the_floor_up(carried, monkeypatch, version):
    libraries = carried(torch_version="2.14.1+cu130")
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(torch.version, "cuda", "13.1")
    assert build.prebuilt("plain", [(9, 0)]) == (libraries["plain"], "")


def test_carried_kernels_are_not_loaded_below_the_floor_or_on_another_cuda_major(carried, monkeypatch):
    carried()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch, "__version__", "2.9.1+cu130")
    found, why = build.prebuilt("plain", [(9, 0)])
    assert found is None and "need torch 2.10 or newer, not 2.9.1+cu130" in why
    monkeypatch.setattr(torch, "__version__", "2.14.1+cu128")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    found, why = build.prebuilt("plain", [(9, 0)])
    assert found is None and "are for CUDA 13, and this torch is built with CUDA 12.8" in why


def test_a_build_that_fits_the_carried_kernels_loads_them(carried, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch, "__version__", "2.14.1+cu130")
    libraries = carried()
    loaded = []
    monkeypatch.setattr(build, "_load_library", lambda path, directory: loaded.append(path) or path)
    monkeypatch.setattr(build, "_build_or_load", lambda *args, **kwargs: pytest.fail("compiled"))
    assert build.build("9.0", cxx_autograd=False) == libraries and loaded == list(libraries.values())


class _FakeChild:
    """A stand-in for a child build's process: records its command and when it was waited for."""

    def __init__(self, events: list, command: list[str], **kwargs) -> None:
        self.command, self.events, self.kwargs = command, events, kwargs
        events.append(("spawned", command[command.index("--family") + 1]))

    def wait(self) -> int:
        self.events.append(("waited", self.command[self.command.index("--family") + 1]))
        return 0

    def terminate(self) -> None:
        self.events.append(("terminated", self.command[self.command.index("--family") + 1]))


@pytest.mark.parametrize("force", [False, True])
def test_families_that_need_compiling_compile_side_by_side(tmp_path, monkeypatch, force):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_cores", lambda: 16)
    events: list = []
    children: list[_FakeChild] = []
    monkeypatch.setattr(build, "prebuilt", lambda family, capabilities=None: (None, "no wheel"))
    monkeypatch.setattr(build.subprocess, "Popen",
                        lambda command, **kwargs: children.append(_FakeChild(events, command, **kwargs))
                        or children[-1])

    def build_or_load(family, archs, force=False, why="", beside=()):
        events.append(("built", family.name, force, tuple(beside)))
        return tmp_path / f"{family.name}.so"

    monkeypatch.setattr(build, "_build_or_load", build_or_load)
    libraries = build.build("8.0;9.0+PTX", force=force, cxx_autograd=False)
    assert libraries == {name: tmp_path / f"{name}.so" for name in ("plain", "weighted", "likelihood")}
    # the other families compile in children while this process compiles the plain one; a child's
    # result is loaded after it ends, without compiling again; each build's estimate counts the others
    assert events == [("spawned", "weighted"), ("spawned", "likelihood"),
                      ("built", "plain", force, ("weighted", "likelihood")),
                      ("waited", "weighted"), ("built", "weighted", False, ("likelihood",)),
                      ("waited", "likelihood"), ("built", "likelihood", False, ("weighted",)),
                      ("waited", "weighted"), ("waited", "likelihood")]
    for child, name, beside in zip(children, ("weighted", "likelihood"), ("plain,likelihood", "plain,weighted")):
        assert child.command[1:] == ["-m", "fusedloss", "build", "--family", name, "--arch", "8.0;9.0+PTX"] + (
            ["--force"] if force else [])
        assert child.command[0] == sys.executable and str(SRC) in child.kwargs["env"]["PYTHONPATH"].split(os.pathsep)
        assert child.kwargs["env"][build._BESIDE_ENV] == beside


def test_a_cached_family_starts_no_child_and_a_failed_build_stops_the_children(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_cores", lambda: 16)
    events: list = []
    monkeypatch.setattr(build, "prebuilt", lambda family, capabilities=None: (None, "no wheel"))
    monkeypatch.setattr(build.subprocess, "Popen", lambda command, **kwargs: _FakeChild(events, command, **kwargs))
    cached = [tmp_path / build.build_name(["9.0"], name) for name in ("weighted", "likelihood")]
    for directory in cached:
        directory.mkdir()
        (directory / "build-complete").touch()
    monkeypatch.setattr(build, "_build_or_load", lambda family, *args, **kwargs: tmp_path / f"{family.name}.so")
    build.build("9.0", cxx_autograd=False)
    assert events == []
    (cached[0] / "build-complete").unlink()

    def failing(family, *args, **kwargs):
        raise build.KernelsUnavailableError(f"{family.name} failed")

    monkeypatch.setattr(build, "_build_or_load", failing)
    with pytest.raises(build.KernelsUnavailableError, match="plain failed"):
        build.build("9.0", cxx_autograd=False)
    assert events == [("spawned", "weighted"), ("terminated", "weighted"), ("waited", "weighted")]


def test_on_few_cores_the_families_compile_one_after_the_other(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_cores", lambda: build.SIDE_BY_SIDE_FROM_CORES - 1)
    monkeypatch.setattr(build, "prebuilt", lambda family, capabilities=None: (None, "no wheel"))
    monkeypatch.setattr(build.subprocess, "Popen", lambda *args, **kwargs: pytest.fail("a child was started"))
    built = []
    monkeypatch.setattr(build, "_build_or_load", lambda family, archs, force=False, why="", beside=():
                        built.append((family.name, force, tuple(beside))) or tmp_path)
    build.build("9.0", force=True, cxx_autograd=False)
    assert built == [("plain", True, ()), ("weighted", True, ()), ("likelihood", True, ())]


@pytest.mark.parametrize("cores", [build.SIDE_BY_SIDE_FROM_CORES - 1, 16])
def test_the_cxx_autograd_counts_in_the_estimates_of_the_builds_beside_it(tmp_path, monkeypatch, cores):
    """The C++ autograd compiles in a thread beside the first family compiled here; one after
    the other (few cores) the later families compile after it."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_cores", lambda: cores)
    monkeypatch.setattr(build, "prebuilt", lambda family, capabilities=None: (None, "no wheel"))
    events: list = []
    monkeypatch.setattr(build.subprocess, "Popen", lambda command, **kwargs: _FakeChild(events, command, **kwargs))
    autograd_builds = []

    @contextlib.contextmanager
    def autograd_compiling(wanted, builds_beside):
        autograd_builds.append(builds_beside)
        yield wanted

    monkeypatch.setattr(build, "_cxx_autograd_compiling", autograd_compiling)
    monkeypatch.setattr(build, "load_cxx_autograd", lambda build_if_missing: False)
    built = {}

    def build_or_load(family, archs, force=False, why="", beside=()):
        built[family.name] = tuple(beside)
        return tmp_path

    monkeypatch.setattr(build, "_build_or_load", build_or_load)
    build.build("9.0", force=True)
    if cores < build.SIDE_BY_SIDE_FROM_CORES:
        assert autograd_builds == [1]
        assert built == {"plain": (build._CXX_AUTOGRAD,), "weighted": (), "likelihood": ()}
    else:
        assert autograd_builds == [3]
        assert built["plain"] == ("weighted", "likelihood", build._CXX_AUTOGRAD)


def test_a_build_estimate_counts_the_builds_that_share_the_cores(monkeypatch):
    """The "about N s" line: a family's own work over the cores (with ninja's tail), never
    less than its slowest object, and longer by the work of the builds beside it, each up to
    this one's own; per architecture."""
    monkeypatch.setattr(build, "_cores", lambda: 16)
    total, slowest = build._CORE_SECONDS["plain"]
    alone = build._expected_seconds(["9.0"], "plain")
    assert alone == round(max(slowest, total / 16 + build._TAIL_SHARE * slowest))
    beside_weighted = build._expected_seconds(["9.0"], "plain", ["weighted"])
    assert beside_weighted == round(2 * total / 16 + build._TAIL_SHARE * slowest)  # weighted's work is larger
    assert (build._expected_seconds(["9.0"], "plain", [build._CXX_AUTOGRAD])
            == round(max(slowest, (total + build._CXX_AUTOGRAD_SECONDS) / 16 + build._TAIL_SHARE * slowest)))
    assert build._expected_seconds(["8.0", "9.0"], "plain") == round(2 * max(slowest, total / 16
                                                                            + build._TAIL_SHARE * slowest))
    monkeypatch.setattr(build, "_cores", lambda: 2)
    assert build._expected_seconds(["9.0"], "weighted") > 2 * build._expected_seconds(["9.0"], "plain")
    # the C++ autograd's one job shares the cores with every ninja job beside it
    monkeypatch.setattr(build, "_cores", lambda: 16)
    assert build._expected_cxx_autograd_seconds(0) == build._CXX_AUTOGRAD_SECONDS
    assert build._expected_cxx_autograd_seconds(2) == round(build._CXX_AUTOGRAD_SECONDS * 37 / 16)
