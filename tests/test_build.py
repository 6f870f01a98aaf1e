"""The build: source assembly, cache location, and the command line."""

from __future__ import annotations

import os
import subprocess
import time
import sys
from pathlib import Path

import pytest
import torch

from fusedloss import build

SRC = Path(__file__).resolve().parents[1] / "src"


def test_read_source_pastes_local_includes_once():
    text = build.read_source("loss_kernels.cu")
    assert '#include "' not in text and "#pragma once" not in text
    assert text.count("struct LossProblem {") == 1
    assert "__global__" in text and "struct HuberLoss" in text
    host = build.read_source("fusedloss_ops.cpp")
    assert "TORCH_LIBRARY_IMPL(fusedloss, CUDA, m)" in host and "struct LossProblem {" in host


def test_build_root_honours_torch_extensions_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build.build_root() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    from torch.utils.cpp_extension import get_default_build_root

    assert build.build_root() == Path(get_default_build_root())


def test_package_ships_the_kernel_sources():
    names = {p.name for p in build.CSRC.iterdir()}
    assert {"launch.h", "dtypes.cuh", "losses.cuh", "elementwise.cuh", "exact_sum.cuh", "loss_kernels.cu",
            "fusedloss_ops.cpp"} <= names


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.run([sys.executable, "-m", "fusedloss", *args], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_bench_without_gpu_says_so_and_exits_0():
    result = _cli("bench")
    assert result.returncode == 0, result.stderr
    first, *rest = result.stdout.splitlines()
    assert "no CUDA device" in first
    assert any(line.startswith("mse") for line in rest)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_build_without_gpu_fails_cleanly():
    result = _cli("build")
    assert result.returncode == 1 and "no CUDA device" in result.stdout


# A process that "builds" with a stand-in for load_inline: it logs the build,
# leaves torch's baton file as a real build does while it runs, takes
# BUILD_SECONDS, and writes the library.
_FAKE_BUILDER = """
import os, sys, time
import torch
import torch.utils.cpp_extension as cpp_extension
from fusedloss import build

def fake_load_inline(name, build_directory, **kwargs):
    with open(os.path.join(build_directory, "builds.log"), "a") as log:
        log.write(name + "\\n")
    open(os.path.join(build_directory, "lock"), "w").close()
    time.sleep(float(os.environ["BUILD_SECONDS"]))
    os.remove(os.path.join(build_directory, "lock"))
    open(os.path.join(build_directory, name + ".so"), "w").close()

cpp_extension.load_inline = fake_load_inline
torch.ops.load_library = lambda path: None
build.arch_flags = lambda: ["-gencode=arch=compute_90,code=sm_90"]
build._check_build_tools = lambda: None
print(build._build_or_load())
"""


def _start_builder(tmp_path, seconds):
    env = dict(os.environ, PYTHONPATH=str(SRC), TORCH_EXTENSIONS_DIR=str(tmp_path), BUILD_SECONDS=str(seconds))
    return subprocess.Popen([sys.executable, "-c", _FAKE_BUILDER], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _build_logs(tmp_path):
    return [line for log in tmp_path.glob("*/builds.log") for line in log.read_text().splitlines()]


def test_processes_starting_together_build_once(tmp_path):
    processes = [_start_builder(tmp_path, 1.0) for _ in range(8)]
    outputs = [p.communicate(timeout=120) for p in processes]
    assert all(p.returncode == 0 for p in processes), [err for _, err in outputs]
    assert len({out.strip() for out, _ in outputs}) == 1
    assert len(_build_logs(tmp_path)) == 1


def test_a_killed_build_does_not_block_the_next_process(tmp_path):
    first = _start_builder(tmp_path, 60.0)
    deadline = time.monotonic() + 60
    while not _build_logs(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    first.kill()  # SIGKILL mid-build: torch's baton file stays behind
    first.wait()
    assert list(tmp_path.glob("*/lock"))
    second = _start_builder(tmp_path, 0.1)
    out, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    assert len(_build_logs(tmp_path)) == 2 and out.strip().endswith(".so")
