"""Graceful degradation: when the kernels cannot be built, warn once and fall back to
torch.nn.functional, or raise under FUSEDLOSS_REQUIRE_KERNELS=1.

On the CPU the missing pieces are simulated: a GPU that torch reports, and a
toolchain with nvcc, ninja or the GPU's architecture missing, or an nvcc that
fails to compile. On a GPU, a subprocess runs with nvcc hidden.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import cpp_extension

import fusedloss
from fusedloss import build, routing

from conftest import requires_cuda

SRC = Path(__file__).resolve().parents[1] / "src"


def _fake_nvcc(directory: Path, compile_error: str | None = None) -> Path:
    """A CUDA_HOME whose bin/nvcc lists sm_75..sm_90 and compiles nothing (fails, if asked), and
    logs each call to nvcc.log."""
    nvcc = directory / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    (directory / "include").mkdir()
    (directory / "include" / "cuda_runtime.h").write_text("")
    failure = f'echo "{compile_error}" >&2; exit 1' if compile_error else "exit 0"
    nvcc.write_text(
        "#!/bin/sh\n"
        f'echo "$1" >> "{directory}/nvcc.log"\n'
        'if [ "$1" = "--list-gpu-arch" ]; then echo compute_75; echo compute_80; echo compute_90; exit 0; fi\n'
        f"{failure}\n"
    )
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    return directory


def _fake_cxx(directory: Path) -> str:
    """A host compiler named as torch expects one (g++, of a version it accepts) that compiles
    nothing, at once."""
    cxx = directory / "g++"
    directory.mkdir(parents=True, exist_ok=True)
    cxx.write_text('#!/bin/sh\ncase "$1" in -dumpfullversion) echo 12.2.0;; esac\nexit 0\n')
    cxx.chmod(cxx.stat().st_mode | stat.S_IXUSR)
    return str(cxx)


def _forget_this_process(monkeypatch) -> None:
    """As in a new process: no build tried, no library loaded, no warning given."""
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "_load_failures", {})
    monkeypatch.setattr(build, "_fallback_warned", False)


@pytest.fixture
def simulated_gpu(monkeypatch, tmp_path):
    """A process that sees one sm_90 GPU, has not tried to build yet, carries no compiled
    kernels (also where the suite runs from a wheel), finds only a stand-in nvcc, and builds
    into tmp_path."""
    _forget_this_process(monkeypatch)
    monkeypatch.setattr(build, "prebuilt", lambda *args, **kwargs: (None, "this install carries no compiled kernels"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    # fake CUDA tensors, which (on some torch versions) make a real one first where CUDA is available
    monkeypatch.setattr(fake_tensor, "init_gpu_context", lambda device: None)
    monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "13.0")
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    monkeypatch.setattr(build, "_pip_toolkit", lambda major: None)
    monkeypatch.setenv("CUDA_HOME", str(_fake_nvcc(tmp_path / "cuda")))
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.delenv(build.REQUIRE_KERNELS_ENV, raising=False)
    return monkeypatch


def _fallback_warnings(calls: int = 2) -> tuple[list[bool], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        answers = [build.use_kernels() for _ in range(calls)]
    return answers, [str(w.message) for w in caught if issubclass(w.category, build.FallbackWarning)]


def test_missing_nvcc_warns_once_with_the_pip_command(simulated_gpu, tmp_path):
    simulated_gpu.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    answers, messages = _fallback_warnings()
    assert answers == [False, False] and len(messages) == 1
    assert "nvcc was not found" in messages[0] and build.toolkit_install_command() in messages[0]
    assert "FUSEDLOSS_REQUIRE_KERNELS=1" in messages[0] and "torch.nn.functional" in messages[0]


def test_missing_ninja_warns_once_with_the_fix(simulated_gpu):
    simulated_gpu.setattr(cpp_extension, "is_ninja_available", lambda: False)
    answers, messages = _fallback_warnings()
    assert answers == [False, False] and len(messages) == 1
    assert "ninja was not found" in messages[0] and "pip install ninja" in messages[0]


def test_unsupported_architecture_warns_once_with_the_fix(simulated_gpu):
    simulated_gpu.setattr(torch.cuda, "get_device_capability", lambda index=None: (5, 2))
    answers, messages = _fallback_warnings()
    assert answers == [False, False] and len(messages) == 1
    assert "compute capability 5.2" in messages[0] and "CUDA_VISIBLE_DEVICES" in messages[0]


@pytest.mark.skipif(not Path("/usr/local/cuda/bin/nvcc").exists(), reason="needs a real nvcc")
def test_unsupported_architecture_with_the_real_nvcc(simulated_gpu):
    simulated_gpu.setenv("CUDA_HOME", "/usr/local/cuda")
    simulated_gpu.setattr(torch.cuda, "get_device_capability", lambda index=None: (3, 5))
    answers, messages = _fallback_warnings(1)
    assert answers == [False] and "compute capability 3.5" in messages[0]


def test_compile_error_warns_once_and_is_remembered_across_processes(simulated_gpu, tmp_path):
    """The real cpp_extension.load and ninja; only nvcc is a stand-in that fails like a compile error."""
    error = "reduced_loss.cu(12): error: identifier broken is undefined"
    cuda = _fake_nvcc(tmp_path / "failing", error)
    simulated_gpu.setenv("CUDA_HOME", str(cuda))
    simulated_gpu.setenv("CXX", _fake_cxx(tmp_path / "host"))  # the host half compiles to nothing
    answers, messages = _fallback_warnings()
    assert answers == [False, False] and len(messages) == 1
    assert "compiling the plain CUDA kernels" in messages[0] and "identifier broken is undefined" in messages[0]
    assert "reduced_loss.cu" in messages[0]  # errors point at the real files
    assert not list((tmp_path / "extensions").glob("*/build-complete"))
    assert len(list((tmp_path / "extensions").glob("*/build-failed-*.txt"))) == 1
    compiles = (cuda / "nvcc.log").read_text().count("--list-gpu-arch")

    # The next process warns at once with the recorded error, and nvcc is not run again.
    _forget_this_process(simulated_gpu)
    answers, messages = _fallback_warnings()
    assert answers == [False, False] and len(messages) == 1
    assert "an earlier build" in messages[0] and "identifier broken is undefined" in messages[0]
    assert "python -m fusedloss build --force" in messages[0]
    assert (cuda / "nvcc.log").read_text().count("--list-gpu-arch") == compiles

    # Another compiler is another key: it gets its own try.
    _forget_this_process(simulated_gpu)
    other = _fake_nvcc(tmp_path / "other", error)
    simulated_gpu.setenv("CUDA_HOME", str(other))
    _fallback_warnings(1)
    assert (other / "nvcc.log").exists()


def test_a_failed_build_is_tried_once_per_process(simulated_gpu):
    attempts = []

    def failing_check(toolkit, archs):
        attempts.append(1)
        raise build.KernelsUnavailableError("ninja was not found.")

    simulated_gpu.setattr(build, "_check_build_tools", failing_check)
    _fallback_warnings(5)
    assert len(attempts) == 1


def test_require_kernels_turns_the_fallback_into_an_error(simulated_gpu):
    simulated_gpu.setattr(cpp_extension, "is_ninja_available", lambda: False)
    simulated_gpu.setenv(build.REQUIRE_KERNELS_ENV, "1")
    mode, x, y = _fake_cuda_operands()
    with mode:
        for _ in range(2):  # every call, not only the first
            with pytest.raises(build.KernelsUnavailableError, match="pip install ninja"):
                fusedloss.mse_loss(x, y)


def _fake_cuda_operands():
    with FakeTensorMode() as mode:
        return mode, torch.empty(4, 3, device="cuda"), torch.empty(4, 3, device="cuda")


def test_functional_falls_back_to_torch(simulated_gpu):
    """CUDA operands (fake ones here) go to torch.nn.functional, and the fused op is never called."""
    simulated_gpu.setattr(cpp_extension, "is_ninja_available", lambda: False)

    def fused_op_called(*args):
        raise AssertionError("the fused op ran although the kernels are unavailable")

    simulated_gpu.setattr(routing, "fused_loss", fused_op_called)
    mode, x, y = _fake_cuda_operands()
    with warnings.catch_warnings(record=True) as caught, mode:
        warnings.simplefilter("always")
        for reduction in ("none", "mean", "sum"):
            out = fusedloss.smooth_l1_loss(x, y, reduction=reduction, beta=0.5)
            expected = F.smooth_l1_loss(x, y, reduction=reduction, beta=0.5)
            assert (out.shape, out.dtype, out.device) == (expected.shape, expected.dtype, expected.device)
    fallbacks = [w for w in caught if issubclass(w.category, build.FallbackWarning)]
    assert len(fallbacks) == 1 and fallbacks[0].filename == __file__


def test_import_does_not_pull_in_dynamo():
    code = "import sys, fusedloss; print('torch._dynamo' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=str(SRC)), timeout=120)
    assert result.stdout.strip() == "False", result.stderr


def test_compiled_code_decides_once_without_tracing_the_build():
    """use_kernels takes a lock and touches files: torch.compile must call it, not trace it."""
    compiled = torch.compile(lambda x: x + 1 if build.use_kernels() else x - 1, fullgraph=True)
    assert compiled(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]


_HIDDEN_NVCC = """
import warnings, torch, torch.nn.functional as F, fusedloss
warnings.simplefilter("always")
p = torch.randn(1000, 37, device="cuda") * 3
t = torch.randn(1000, 37, device="cuda")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    same = [torch.equal(fusedloss.huber_loss(p, t, delta=0.5), F.huber_loss(p, t, delta=0.5)) for _ in range(3)]
print(same, sum("nvcc was not found" in str(w.message) for w in caught))
"""


@requires_cuda
@pytest.mark.parametrize("required", ["0", "1"])
def test_on_a_gpu_without_nvcc(tmp_path, required):
    env = dict(os.environ, PYTHONPATH=str(SRC), CUDA_HOME=str(tmp_path / "no-cuda"),
               TORCH_EXTENSIONS_DIR=str(tmp_path), FUSEDLOSS_REQUIRE_KERNELS=required)
    result = subprocess.run([sys.executable, "-c", _HIDDEN_NVCC], capture_output=True, text=True, env=env,
                            timeout=300)
    if required == "1":
        assert result.returncode != 0 and "KernelsUnavailableError: nvcc was not found" in result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["[True,", "True,", "True]", "1"]


def test_an_architecture_variant_counts_as_its_base(simulated_gpu, tmp_path):
    # nvcc --list-gpu-arch names compute_90, not compute_90a.
    toolkit = build.Toolkit(tmp_path / "cuda", "system")
    build._check_build_tools(toolkit, ["9.0a", "9.0+PTX"])
    with pytest.raises(build.KernelsUnavailableError, match="compute capability 10.0a"):
        build._check_build_tools(toolkit, ["10.0a"])
