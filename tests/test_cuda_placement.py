"""Where and when the kernels run: the operands' own GPU, the current stream, several threads."""

from __future__ import annotations

import threading

import pytest
import torch

from fusedloss import build, formulas, routing

from conftest import LOSSES, PARAMS, assert_close_to_reference, heavy_tailed, loss_kwargs, requires_cuda

pytestmark = requires_cuda
requires_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@pytest.fixture(autouse=True)
def kernels():
    build.load()


def _loss(name, input, target, reduction="mean"):
    return LOSSES[name][0](input, target, reduction=reduction, **loss_kwargs(name, PARAMS[name]))


def _reference(name, input, target, reduction="mean"):
    return formulas.torch_loss(input.double(), target.double(), name, PARAMS[name], reduction)


def _kernel_devices(fn) -> set[int]:
    """The devices fusedloss's kernels ran on while `fn` ran, from the profiler's trace."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        fn()
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)
    devices = {event.device_index for event in profile.events()
               if event.device_type == torch.autograd.DeviceType.CUDA and "fusedloss" in event.name}
    assert devices, "no fusedloss kernel in the trace"
    return devices


@requires_two_gpus
@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_operands_on_cuda1_are_computed_on_cuda1(name, reduction):
    input = heavy_tailed((1000, 37), device="cuda:1").requires_grad_()
    target = heavy_tailed((1000, 37), device="cuda:1").requires_grad_()
    results = {}

    def step():
        out = _loss(name, input, target, reduction)
        out.backward(torch.full_like(out, 0.5))
        results["out"] = out

    with torch.cuda.device(0):
        assert _kernel_devices(step) == {1}
    out = results["out"]
    assert out.device == torch.device("cuda:1") and input.grad.device == torch.device("cuda:1")
    assert_close_to_reference(out, _reference(name, input, target, reduction), torch.float32)
    i64, t64 = input.detach().double().requires_grad_(), target.detach().double().requires_grad_()
    ref = formulas.torch_loss(i64, t64, name, PARAMS[name], reduction)
    ref.backward(torch.full_like(ref, 0.5))
    torch.testing.assert_close(input.grad.double(), i64.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(target.grad.double(), t64.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
def test_a_default_device_keeps_the_kernels(name, reduction, weighted, monkeypatch):
    """torch.set_default_device and ``with torch.device(...)`` are torch function modes that
    only place the tensors factory functions make: under them the kernels still run, with the
    same bits as without."""
    monkeypatch.setattr(routing, "pytorch_serves_the_step", lambda *args: False)
    input = heavy_tailed((1000, 37), device="cuda").requires_grad_()
    target = heavy_tailed((1000, 37), device="cuda")
    weight = torch.rand(1, 37, device="cuda") if weighted else None

    def step():
        input.grad = None
        out = LOSSES[name][0](input, target, reduction=reduction, weight=weight, **loss_kwargs(name, PARAMS[name]))
        out.backward(torch.full_like(out, 0.5))
        return out.detach(), input.grad

    expected = step()
    for place in ("cuda", "cpu", "meta"):
        results = []
        with torch.device(place):
            assert _kernel_devices(lambda: results.extend(step())) == {0}
        for got, want in zip(results, expected):
            assert torch.equal(got, want)


@requires_two_gpus
@pytest.mark.parametrize("name", LOSSES)
def test_grad_output_prediction_on_cuda1(name, monkeypatch):
    """The notes of grad_output are host memory mapped for every device: a backward on
    cuda:1 notes there, and the next forward on cuda:1 expects it, with the same bits."""

    calls = []
    real = routing.apply
    monkeypatch.setattr(build, "cxx_autograd_loaded", lambda: False)  # every forward through routing.apply
    monkeypatch.setattr(routing, "apply", lambda function, op, differentiable, *args: calls.append(args[5:8])
                        or real(function, op, differentiable, *args))
    monkeypatch.setattr(routing, "FUSED_GRADIENT_FROM_BYTES", 0)  # the forward writes this small loss's gradient
    input, target = heavy_tailed((1000, 37), device="cuda:1"), heavy_tailed((1000, 37), device="cuda:1")
    steps = []
    with torch.cuda.device(0):
        for _ in range(3):
            leaf = input.clone().requires_grad_()
            out = _loss(name, leaf, target)
            (out * 0.5).backward()
            torch.cuda.synchronize(1)  # the note is written
            steps.append((out, leaf.grad))
    # Corrected in backward, then computed in backward after the misprediction, then expected.
    assert [(call[0], call[2]) for call in calls] == [([True, False], 1.0), ([False, False], 0.5),
                                                      ([True, False], 0.5)]
    for step in steps[1:]:
        for a, b in zip(steps[0], step):
            assert b.device == torch.device("cuda:1") and torch.equal(a, b)
    i64 = input.double().requires_grad_()
    (formulas.torch_loss(i64, target.double(), name, PARAMS[name], "mean") * 0.5).backward()
    torch.testing.assert_close(steps[2][1].double(), i64.grad, rtol=1e-5, atol=1e-7)


@requires_two_gpus
def test_cuda_graph_on_cuda1():
    """Capture on cuda:1 with the warm-up pattern of PyTorch's CUDA-graph docs; the
    replay must see inputs written after the capture."""
    input, target = heavy_tailed((4099,), device="cuda:1"), heavy_tailed((4099,), device="cuda:1")
    with torch.cuda.device(1):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _loss("huber", input, target, "mean")  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = _loss("huber", input, target, "mean")
        input.copy_(heavy_tailed((4099,), device="cuda:1"))
        graph.replay()  # on cuda:1's current stream, after the copy
    torch.cuda.synchronize(1)
    assert_close_to_reference(out, _reference("huber", input, target), torch.float32)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("other", ["cpu", pytest.param("cuda:1", marks=requires_two_gpus)])
def test_operands_on_different_devices_raise_torchs_error(name, other):
    input, target = torch.randn(8, device="cuda:0"), torch.randn(8, device=other)
    ours, theirs, _ = LOSSES[name]
    for a, b in ((input, target), (target, input)):
        with pytest.raises(RuntimeError) as expected:
            theirs(a, b)
        with pytest.raises(RuntimeError) as actual:
            ours(a, b)
        assert str(actual.value) == str(expected.value)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_side_stream_work_stays_ordered(name, reduction):
    """Inputs written on a side stream after a long sleep: a kernel launched on any
    other stream would read them before they are written."""
    shape = (3001, 257)
    input = torch.zeros(shape, device="cuda", requires_grad=True)
    target = torch.zeros(shape, device="cuda")
    new_input, new_target = heavy_tailed(shape, device="cuda"), heavy_tailed(shape, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # tens of milliseconds
        with torch.no_grad():
            input.copy_(new_input)
            target.copy_(new_target)
        out = _loss(name, input, target, reduction)
        out.backward(torch.ones_like(out))
        grad = input.grad.clone()  # consumed on the side stream too
    torch.cuda.current_stream().wait_stream(side)
    assert_close_to_reference(out, _reference(name, new_input, new_target, reduction), torch.float32)
    expected = formulas.loss_grad(new_input.double(), new_target.double(), name, PARAMS[name])
    if reduction == "mean":
        expected = expected / input.numel()
    torch.testing.assert_close(grad.double(), expected, rtol=1e-5, atol=1e-9)


def test_calls_from_many_threads_are_correct():
    """A thread for each loss and reduction, each with its own operands, 50 steps each."""
    cases = [(name, reduction) for name in LOSSES for reduction in ("mean", "sum")]
    operands = [(heavy_tailed((513, 67), device="cuda"), heavy_tailed((67,), device="cuda")) for _ in cases]
    expected = [_reference(name, i, t, reduction) for (name, reduction), (i, t) in zip(cases, operands)]
    errors = []
    barrier = threading.Barrier(len(cases))

    def worker(index):
        name, reduction = cases[index]
        input, target = operands[index]
        try:
            barrier.wait()
            for _ in range(50):
                leaf = input.detach().requires_grad_()
                out = _loss(name, leaf, target, reduction)
                out.backward()
                assert_close_to_reference(out, expected[index], torch.float32)
                assert leaf.grad is not None and leaf.grad.isfinite().all()
        except Exception as error:  # reported by the main thread
            errors.append((cases[index], error))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(cases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
