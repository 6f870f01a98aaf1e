"""kernelbench/ (beside the library): the generated ModelNew files, the static checker and the evaluator.

The evaluator's correctness and anti-gaming logic runs here on the CPU at a
small size, against plain-torch ModelNew files that game the benchmark
(tests/kernelbench_broken/); the generated files themselves are evaluated at
KernelBench's size only where a GPU is visible.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernelbench import evaluate as kernelbench
from kernelbench import export as exporter
from kernelbench import specialize
from kernelbench.__main__ import main as kernelbench_main
from kernelbench.evaluate import evaluate, static_check
from kernelbench.export import PROBLEMS


REPO = Path(__file__).resolve().parents[1]
GENERATED = REPO / "kernelbench" / "generated"
REFERENCE = REPO / "kernelbench" / "reference"
BROKEN = Path(__file__).resolve().parent / "kernelbench_broken"
NAMES = [problem.name for problem in PROBLEMS]
SMALL = (256, 512)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def evaluate_small(ref: Path, new: Path, inputs: str = "rand") -> kernelbench.EvalResult:
    return evaluate(ref, new, inputs=inputs, timing_trials=0, device="cpu", check_static=False, size=SMALL)


# ---- the generated files ------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_checked_in_file_is_a_fresh_export(tmp_path: Path, name: str) -> None:
    exporter.export(tmp_path)
    fresh = (tmp_path / f"{name}.py").read_text()
    checked_in = (GENERATED / f"{name}.py").read_text()
    assert checked_in == fresh, f"kernelbench/generated/{name}.py is stale: run `python -m kernelbench export kernelbench/generated`"


def test_export_is_deterministic(tmp_path: Path) -> None:
    first = [path.read_text() for path in exporter.export(tmp_path / "a")]
    second = [path.read_text() for path in exporter.export(tmp_path / "b")]
    assert first == second


@pytest.mark.parametrize("name", NAMES)
def test_generated_file_passes_static_check(name: str) -> None:
    source = (GENERATED / f"{name}.py").read_text()
    assert static_check(source) == []
    assert "__global__" in source and "load_inline" in source


@pytest.mark.parametrize("problem", PROBLEMS, ids=NAMES)
def test_generated_file_embeds_the_sources_and_keeps_the_problem(problem: exporter.Problem) -> None:
    generated = kernelbench.load_module(GENERATED / f"{problem.name}.py")
    reference = kernelbench.load_module(REFERENCE / f"{problem.name}.py")
    assert generated.CPP_SOURCE == exporter.cpp_source(problem)
    assert generated.CUDA_SOURCE == exporter.cuda_source(problem)
    assert generated.NAMESPACE == problem.namespace != "fusedloss"
    assert str(getattr(torch.ops, generated.NAMESPACE).reduced_loss.default._schema).endswith(exporter.SCHEMA)
    assert f'"{problem.loss}", {problem.param!r}, "mean"' in (GENERATED / f"{problem.name}.py").read_text()
    for name in ("batch_size", "input_shape", "dim"):
        assert getattr(generated, name) == getattr(reference, name)
    assert generated.get_init_inputs() == reference.get_init_inputs() == []
    assert exporter.PROBLEM_INPUTS in (REFERENCE / f"{problem.name}.py").read_text()


# As CUDA, ATen and Python spell them; `half` where it names a type (exact_sum.cuh's rounding has
# a variable `half`).
SIXTEEN_BIT_NAMES = re.compile(
    r"\b(__half|nv_bfloat16|__nv_bfloat16|bfloat16|float16|kHalf|kBFloat16|Half|BFloat16|half2)\b"
    r"|at::Half|\bhalf\b(?=\s*[\w>)*{(,])|static_cast\s*<\s*half|float2half|cuda_fp16|cuda_bf16"
)


@pytest.mark.parametrize("name", NAMES)
def test_generated_file_names_no_16_bit_dtype(name: str) -> None:
    # The problems are float32: KernelBench's checker warns of a precision downgrade where a
    # file names a 16-bit type.
    lines = (GENERATED / f"{name}.py").read_text().splitlines()
    assert [line.strip() for line in lines if SIXTEEN_BIT_NAMES.search(line)] == []


@pytest.mark.parametrize("problem", PROBLEMS, ids=NAMES)
def test_generated_file_holds_its_problem_alone(problem: exporter.Problem) -> None:
    # The forward mean of one loss on float32 operands: no other loss or dtype, no backward,
    # pointwise or weighted kernel.
    generated = kernelbench.load_module(GENERATED / f"{problem.name}.py")
    sources = generated.CPP_SOURCE + generated.CUDA_SOURCE
    assert set(re.findall(r"\bstruct (\w+Loss)\b", sources)) == {"MseLoss" if problem.loss == "mse" else "SmoothL1Loss"}
    assert "enum class DType : int { kFloat32 };" in generated.CUDA_SOURCE
    for absent in ("_backward", "weighted_", "Pointwise", "kFloat64"):
        assert absent not in sources, absent


def test_specializer_fails_where_it_cannot_specialize() -> None:
    with pytest.raises(ValueError, match="FUSEDLOSS_UNKNOWN"):
        specialize.resolve_conditionals("#ifdef FUSEDLOSS_UNKNOWN\nint x;\n#endif\n", specialize.MACROS)
    sixteen_bit_left = [("x.cu", "float f(float x) { return __half2float(__float2half(x)); }\n")]
    with pytest.raises(ValueError, match="other than float32"):
        specialize.translation_unit(sixteen_bit_left, cuda=True, loss="mse", roots={"f"})


_IMPORT_MODEL_NEW = """
import importlib.util
for index, name in enumerate({names!r}):
    spec = importlib.util.spec_from_file_location(f"model_new_{{index}}", {generated!r} + f"/{{name}}.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
"""


def _python(script: str, with_fusedloss: bool) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    if with_fusedloss:
        env["PYTHONPATH"] = str(REPO / "src")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd="/", timeout=300)


def test_generated_files_define_the_schemas_without_fusedloss() -> None:
    # A fresh interpreter with only torch, as under KernelBench: importing the files, each
    # twice, must define each file's operator once and import nothing of fusedloss.
    script = _IMPORT_MODEL_NEW.format(names=NAMES * 2, generated=str(GENERATED)) + textwrap.dedent(
        f"""
        import sys, torch
        assert not any(module.startswith("fusedloss") for module in sys.modules), "imported fusedloss"
        for namespace in {[problem.namespace for problem in PROBLEMS]!r}:
            print(getattr(torch.ops, namespace).reduced_loss.default._schema)
        """
    )
    done = _python(script, with_fusedloss=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"{problem.namespace}::reduced_loss" + exporter.SCHEMA for problem in PROBLEMS]


@pytest.mark.parametrize("fusedloss_first", [True, False])
def test_generated_files_and_fusedloss_import_in_either_order(fusedloss_first: bool) -> None:
    model_new = _IMPORT_MODEL_NEW.format(names=NAMES, generated=str(GENERATED))
    package = "import torch, fusedloss\nfusedloss.mse_loss(torch.ones(3), torch.zeros(3))\n"
    check = textwrap.dedent(
        f"""
        import torch
        for namespace in ("fusedloss", *{[problem.namespace for problem in PROBLEMS]!r}):
            print(getattr(torch.ops, namespace).reduced_loss.default._schema.name)
        """
    )
    done = _python((package + model_new if fusedloss_first else model_new + package) + check, with_fusedloss=True)
    assert done.returncode == 0, done.stderr
    expected = ["fusedloss::reduced_loss"] + [f"{problem.namespace}::reduced_loss" for problem in PROBLEMS]
    assert done.stdout.split() == expected


# ---- the static checker ----------------------------------------------------------------

VALID = textwrap.dedent(
    '''
    import torch
    from torch.utils.cpp_extension import load_inline

    source = """
    __global__ void zero(float* x) { x[blockIdx.x * blockDim.x + threadIdx.x] = 0.f; }
    """
    # A comment may say try: or pass, and bypass is a word like any other.


    class ModelNew(torch.nn.Module):
        def forward(self, x):
            return x
    '''
)


def test_static_check_accepts_a_plain_kernel_file() -> None:
    assert static_check(VALID) == []


@pytest.mark.parametrize(
    ("addition", "expected"),
    [
        ("try:\n    y = 1\nexcept Exception:\n    y = 2\n", "try/except"),
        ("def f():\n    pass\n", "'pass'"),
        ("import threading\n", "threading"),
        ("from multiprocessing import Pool\n", "threading or multiprocessing"),
        ("torch.cuda.Event = object\n", "timing"),
        ("torch.cuda.Event.elapsed_time = lambda self, end: 0.0\n", "timing"),
        ("torch.cuda.synchronize = lambda device=None: None\n", "timing"),
        ("import time\ntime.perf_counter = lambda: 0.0\n", "timing"),
        ("setattr(torch.cuda, 'synchronize', print)\n", "timing"),
        ("class Lazy(torch.Tensor):\n    x = 1\n", "tensor subclass"),
    ],
)
def test_static_check_rejects(addition: str, expected: str) -> None:
    violations = static_check(VALID + addition)
    assert len(violations) == 1 and expected in violations[0], violations


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("__global__", "__host__", "__global__"),
        ("from torch.utils.cpp_extension import load_inline", "import torch.utils.cpp_extension", "load_inline"),
    ],
)
def test_static_check_requires(old: str, new: str, expected: str) -> None:
    violations = static_check(VALID.replace(old, new))
    assert len(violations) == 1 and expected in violations[0], violations


def test_static_check_sees_words_in_strings() -> None:
    # As KernelBench: only comments are stripped, docstrings and sources are read.
    assert static_check(VALID + '"""One pass over the data."""\n')


# ---- the reference problems and the inputs ---------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_reference_problem(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    module = kernelbench.load_module(REFERENCE / f"{name}.py")
    assert (module.batch_size, module.input_shape) == (32768, (32768,))
    assert module.get_init_inputs() == []
    monkeypatch.setattr(module, "batch_size", 4)
    monkeypatch.setattr(module, "input_shape", (8,))
    predictions, targets = module.get_inputs()
    assert predictions.shape == targets.shape == (4, 8)
    assert predictions.dtype == targets.dtype == torch.float32
    loss = module.Model(*module.get_init_inputs())(predictions, targets)
    expected = ((predictions - targets) ** 2).mean() if name == "94_MSELoss" else torch.nn.SmoothL1Loss()(predictions, targets)
    assert loss.shape == () and torch.equal(loss, expected)


def test_heavy_tailed_inputs_reach_both_branches() -> None:
    shape = (64, 1024)
    predictions, targets = kernelbench.heavy_tailed_inputs(shape, generator=torch.Generator().manual_seed(0))
    assert predictions.shape == targets.shape == shape
    assert predictions.dtype == targets.dtype == torch.float32
    assert torch.isfinite(predictions).all() and torch.isfinite(targets).all()
    assert (predictions < 0).any() and (predictions > 0).any()
    distance = (predictions - targets).abs()
    assert 0.05 < (distance > 1).float().mean() < 0.5  # Smooth L1's linear branch
    assert (distance < 1).float().mean() > 0.5  # and its quadratic one
    assert distance.max() > 10
    again = kernelbench.heavy_tailed_inputs(shape, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip((predictions, targets), again))


# ---- the evaluator, on the CPU ---------------------------------------------------------------


@pytest.mark.parametrize("inputs", kernelbench.INPUT_MODES)
@pytest.mark.parametrize("name", NAMES)
def test_reference_as_model_new_passes(tmp_path: Path, name: str, inputs: str) -> None:
    # The reference has a Model, not a ModelNew: alias it in a copy.
    new = tmp_path / f"{name}.py"
    new.write_text((REFERENCE / f"{name}.py").read_text() + "\n\nModelNew = Model\n")
    result = evaluate_small(REFERENCE / f"{name}.py", new, inputs)
    assert result.passed, result.reason
    assert result.correct_trials == result.trials == 5
    assert result.failed_check is None and result.timings == {}


def test_partial_reader_fails_correctness_on_iid_inputs() -> None:
    result = evaluate_small(REFERENCE / "94_MSELoss.py", BROKEN / "first_rows_mse.py")
    assert not result.passed and result.failed_check == "correctness"


def test_partial_reader_is_caught_by_the_perturbation_alone() -> None:
    # Periodic rows make the first 64 rows exact, so every ordinary trial passes.
    result = evaluate_small(BROKEN / "periodic_rows_reference.py", BROKEN / "first_rows_mse.py")
    assert not result.passed
    assert result.correct_trials == result.trials
    assert result.failed_check == "perturbation", result.reason


def test_in_place_writer_is_rejected() -> None:
    result = evaluate_small(REFERENCE / "94_MSELoss.py", BROKEN / "in_place_mse.py")
    assert not result.passed
    assert result.failed_check == "in_place" and "input 0" in result.reason
    assert result.correct_trials == 0


def test_quadratic_only_smooth_l1_passes_rand_trials_but_not_the_perturbation() -> None:
    result = evaluate_small(REFERENCE / "96_HuberLoss.py", BROKEN / "quadratic_only_smooth_l1.py", "rand")
    assert not result.passed
    assert result.correct_trials == result.trials  # what KernelBench alone would accept
    assert result.failed_check == "perturbation", result.reason


def test_quadratic_only_smooth_l1_fails_heavy_inputs() -> None:
    result = evaluate_small(REFERENCE / "96_HuberLoss.py", BROKEN / "quadratic_only_smooth_l1.py", "heavy")
    assert not result.passed
    assert result.failed_check == "correctness" and result.correct_trials == 0, result.reason


def test_evaluate_applies_the_static_check_first() -> None:
    result = evaluate(
        REFERENCE / "94_MSELoss.py", BROKEN / "in_place_mse.py", timing_trials=0, device="cpu", size=SMALL
    )
    assert result.failed_check == "static" and "__global__" in result.reason


def test_evaluate_reports_a_file_that_fails_to_load(tmp_path: Path) -> None:
    broken = tmp_path / "raises.py"
    broken.write_text("raise ImportError('no kernels here')\n")
    result = evaluate_small(REFERENCE / "94_MSELoss.py", broken)
    assert result.failed_check == "load" and "no kernels here" in result.reason


def test_evaluate_times_only_on_cuda() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        evaluate(REFERENCE / "94_MSELoss.py", GENERATED / "94_MSELoss.py", device="cpu", timing_trials=1)


def test_verdict_and_table() -> None:
    result = kernelbench.EvalResult(problem="94_MSELoss.py", inputs="rand", trials=5, passed=True, correct_trials=5)
    for name, mean in (("ModelNew", 1.0), ("eager", 3.0), ("torch.compile", 2.0)):
        result.timings[name] = kernelbench.TimingStats(mean, 0.1, mean - 0.1, mean + 0.1, 100)
    assert result.verdict().startswith("PASS 94_MSELoss.py [rand inputs]: 5/5 trials match")
    assert result.speedup("eager") == 3.0 and result.speedup("torch.compile") == 2.0
    table = result.table().splitlines()
    assert len(table) == 4 and table[1].split()[-2:] == ["3.00x", "2.00x"]


# ---- the command line -----------------------------------------------------------------------


def test_main_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kernelbench_main(["export", str(tmp_path / "out")]) == 0
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == [f"{name}.py" for name in NAMES]
    assert str(tmp_path / "out" / "94_MSELoss.py") in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_main_eval_without_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    status = kernelbench_main(["eval", str(REFERENCE / "94_MSELoss.py"), str(GENERATED / "94_MSELoss.py")])
    assert status == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


# ---- on a GPU, at KernelBench's size ---------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("inputs", kernelbench.INPUT_MODES)
@pytest.mark.parametrize("name", NAMES)
def test_exported_file_passes_on_gpu(name: str, inputs: str, gpu_to_itself: None) -> None:
    # Timing (with its torch.compile) once per problem is enough to exercise it.
    timing_trials = 5 if inputs == "rand" else 0
    result = evaluate(REFERENCE / f"{name}.py", GENERATED / f"{name}.py", inputs=inputs, timing_trials=timing_trials)
    assert result.passed, result.reason
    assert result.correct_trials == result.trials == 5
    assert len(result.timings) == (3 if timing_trials else 0)


@requires_cuda
@pytest.mark.parametrize(
    ("broken", "reference", "failed_checks"),
    [
        # At 2**30 elements, 64 rows' mean may pass an i.i.d. trial; the perturbation catches it then.
        ("first_rows_mse.py", "94_MSELoss.py", {"correctness", "perturbation"}),
        ("in_place_mse.py", "94_MSELoss.py", {"in_place"}),
        ("quadratic_only_smooth_l1.py", "96_HuberLoss.py", {"perturbation"}),
    ],
)
def test_broken_file_fails_on_gpu(broken: str, reference: str, failed_checks: set[str],
                                  gpu_to_itself: None) -> None:
    result = evaluate(REFERENCE / reference, BROKEN / broken, trials=1, timing_trials=0, check_static=False)
    assert not result.passed and result.failed_check in failed_checks, result.reason
