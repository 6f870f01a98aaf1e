"""DTensor operands: the fused operators' sharding rules and the sharded route, against
the same loss on full tensors, values and gradients, for every loss and reduction, even
and uneven shards, 1-D and 2-D meshes, weights sharded alike or replicated and
broadcast, scales and dim=.

On the CPU: 4 ranks of the gloo backend, each through fusedloss's operators (their CPU
kernels, as the "fused-cpu" route of the other tests): the rules, the route and the
collectives are DTensor's real ones, the kernels the CPU reference kernels. With two
GPUs: 2 ranks of NCCL on the CUDA kernels, 1-D and 2-D meshes of them."""

from __future__ import annotations

import contextlib
import itertools
import math
import random
import traceback
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import LOSSES, process_group

SHAPE = (7, 5, 3)  # uneven over 2 and 4 ranks along every dimension
MESHES = {"cpu": ((4,), (2, 2)), "cuda": ((2,), (1, 2))}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                                reason="needs two CUDA devices"))]


def _cases(device):
    from conftest import LOSSES, PARAMS  # noqa: F401  (the table's losses and numbers)
    from torch.distributed.tensor import Replicate, Shard

    flat, square = MESHES[device]
    world = flat[0]
    meshes = {flat: [[Shard(0)], [Shard(1)], [Shard(2)], [Replicate()]],
              square: [[Shard(0), Shard(1)], [Shard(0), Replicate()], [Replicate(), Shard(2)], [Shard(1), Shard(1)]]}
    rng = random.Random(0)
    for (mesh_shape, placements_list), name, reduction in itertools.product(
            meshes.items(), LOSSES, ["none", "mean", "sum"]):
        for placements in placements_list:
            weight = rng.choice([None, "sharded", "broadcast", "mask"])
            scale = rng.choice([None, 0.5, "tensor"])
            dim = rng.choice([None, None, (1, 2)]) if reduction != "none" else None
            yield dict(mesh_shape=mesh_shape, placements=placements, name=name, reduction=reduction, weight=weight,
                       scale=scale, dim=dim, param=PARAMS[name], world=world)
    # operands placed unlike each other (DTensor redistributes them to a rule's strategy),
    # and a partial input (torch.nn.functional's route, which DTensor shards itself)
    for name, reduction in itertools.product(LOSSES, ["none", "mean", "sum"]):
        yield dict(mesh_shape=flat, placements=[Shard(0)], target_placements=[Shard(1)], name=name,
                   reduction=reduction, weight=None, scale=None, dim=None, param=PARAMS[name], world=world)
        yield dict(mesh_shape=flat, placements=[Shard(2)], partial_input=True, name=name, reduction=reduction,
                   weight="broadcast", scale=0.5, dim=None, param=PARAMS[name], world=world)


def _run_case(case, mesh, device):
    from conftest import LOSSES
    from torch.distributed.tensor import DTensor, Partial, distribute_tensor

    torch.manual_seed(zlib.crc32(repr(case).encode()))  # the same operands on every rank
    fn = LOSSES[case["name"]][0]
    keyword = LOSSES[case["name"]][2]
    x, y = (torch.randn(SHAPE) * 2).to(device), (torch.randn(SHAPE) * 2).to(device)
    w_full = {None: None, "sharded": torch.rand(SHAPE) + 0.25, "broadcast": torch.rand(1, 5, 1) + 0.25,
              "mask": torch.rand(SHAPE) < 0.6}[case["weight"]]
    w_full = None if w_full is None else w_full.to(device)
    scale = torch.tensor(0.75, device=device) if case["scale"] == "tensor" else case["scale"]
    kwargs = dict(reduction=case["reduction"], scale=scale, **({keyword: case["param"]} if keyword else {}))
    if case["dim"] is not None:
        kwargs["dim"] = case["dim"]
    placements = case["placements"]
    if case.get("partial_input"):  # each rank holds a part; their sum is x
        part = x / case["world"]
        dx = DTensor.from_local(part, mesh, [Partial()], run_check=False).requires_grad_()
    else:
        dx = distribute_tensor(x, mesh, placements).requires_grad_()
    dy = distribute_tensor(y, mesh, case.get("target_placements", placements))
    if case["weight"] in ("sharded", "mask"):
        dw = distribute_tensor(w_full, mesh, placements)
        if case["weight"] == "sharded":
            dw.requires_grad_()
    else:
        dw = w_full  # a plain tensor: taken as replicated
    from fusedloss import sharding

    before = sharding.sharded_loss.calls
    try:
        out = fn(dx, dy, weight=dw, **kwargs)
    except NotImplementedError as error:
        # DTensor's own rules, which a partial input takes, lack some of PyTorch's losses
        # before torch 2.11: then the error is PyTorch's own, as torch.nn.functional gives it
        from fusedloss.losses import LOSSES as ROWS

        row = ROWS[case["name"]]
        assert case.get("partial_input") and row.pytorch and "sharding strategy" in str(error), error
        with pytest.raises(NotImplementedError, match="sharding strategy"):
            row.torch_function(dx, dy)
        return
    assert isinstance(out, DTensor)
    # the fused route on each rank's shards, except for a partial input (DTensor's own)
    assert (sharding.sharded_loss.calls > before) != bool(case.get("partial_input")), "route"
    full_x = x.clone().requires_grad_()
    full_w = None if w_full is None else w_full.clone().requires_grad_(case["weight"] == "sharded")
    expected = fn(full_x, y, weight=full_w, **kwargs)
    got = out.full_tensor()
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-6, msg="value")
    if case["reduction"] != "none" and case["dim"] is None and not case.get("partial_input"):
        # a pending sum where DTensor ran the loss sharded, as its own reductions leave it
        assert all(p.is_replicate() or p == Partial() for p in out.placements), out.placements
    g = torch.randn(expected.shape).to(device)
    wrt = [dx] + ([dw] if case["weight"] == "sharded" else [])
    grads = torch.autograd.grad((got * g).sum(), wrt)
    want = torch.autograd.grad((expected * g).sum(), [full_x] + ([full_w] if case["weight"] == "sharded" else []))
    for grad, w in zip(grads, want):
        assert isinstance(grad, DTensor)
        torch.testing.assert_close(grad.full_tensor(), w, rtol=2e-5, atol=2e-6, msg="gradient")
    assert dx.to_local().shape == x.shape or any(p.is_shard() for p in placements)


def _worker(rank, device, init_file, results_dir):
    world = MESHES[device][0][0]
    with process_group(rank, world, init_file, device):
        failures, count, local = [], 0, 0
        try:
            from torch.distributed.tensor import init_device_mesh

            from conftest import cpu_through_operators

            from fusedloss import sharding
            if device == "cpu":
                cpu_through_operators()
            counted, on_local_shards = sharding.sharded_loss, sharding.on_local_shards

            def counting(*args, **kwargs):  # the operators' route
                counting.calls += 1
                return counted(*args, **kwargs)

            def counting_local(*args, **kwargs):  # the local shards' route, where it takes the call
                out = on_local_shards(*args, **kwargs)
                counting.calls += out is not None
                counting.local += out is not None
                return out

            counting.calls = counting.local = 0
            sharding.sharded_loss, sharding.on_local_shards = counting, counting_local
            meshes = {}
            for case in _cases(device):
                shape = case["mesh_shape"]
                mesh = meshes.setdefault(shape, init_device_mesh(device, shape))
                count += 1
                try:
                    _run_case(case, mesh, device)
                except Exception as error:  # each failure is a result; the ranks keep in step
                    failures.append(f"{case}: {type(error).__name__}: {error}\n{traceback.format_exc(limit=3)}")
        finally:
            local = getattr(sharding.sharded_loss, "local", 0) if count else 0
            (Path(results_dir) / f"rank{rank}.txt").write_text(f"{count} {local}\n" + "\n".join(failures))


@contextlib.contextmanager
def _two_ranks(rank, device, init_file, results_dir):
    """A spawned rank of two: gloo through fusedloss's CPU operators, or NCCL on the CUDA
    kernels with one card per rank and CUDA as the default device (which keeps the kernels:
    a default device only places new tensors). Yields a 1-D mesh and the list of failures,
    which goes to the rank's results file at the end."""
    with process_group(rank, 2, init_file, device):
        failures = []
        try:
            from torch.distributed.tensor import init_device_mesh

            from conftest import cpu_through_operators
            from fusedloss import build

            if device == "cpu":
                cpu_through_operators()
            else:  # the operators' CUDA kernels, which a worker may call directly
                build.load()
                torch.set_default_device(device)
            mesh = init_device_mesh(device, (2,))
            torch.manual_seed(0)
            yield mesh, failures
        finally:
            (Path(results_dir) / f"rank{rank}.txt").write_text("\n".join(failures))


def _spawn_two_ranks(worker, device, tmp_path) -> None:
    """Runs `worker` on two ranks; each rank's failures fail the test."""
    torch.multiprocessing.spawn(worker, args=(device, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    for rank in range(2):
        failures = (tmp_path / f"rank{rank}.txt").read_text()
        assert not failures, failures


def _other_losses_worker(rank, device, init_file, results_dir):
    """The losses a DTensor takes through torch operations (several quantiles, a tensor c,
    the Gaussian and Poisson NLL), against full tensors, unevenly sharded."""
    with _two_ranks(rank, device, init_file, results_dir) as (mesh, failures):
        from torch.distributed.tensor import Shard, distribute_tensor

        import fusedloss
        x, y, var = torch.randn(7, 5, 3), torch.randn(7, 5, 1), torch.rand(7, 5) + 0.5
        counts = torch.poisson(torch.rand(7, 5, 3) * 4)
        calls = {
            "quantiles": lambda a, b, v, c, r: fusedloss.quantile_loss(a, b, [0.1, 0.5, 0.9], reduction=r),
            "pseudo-huber c": lambda a, b, v, c, r: fusedloss.pseudo_huber_loss(a, b.expand(a.shape) * 1,
                                                                               torch.tensor([0.5, 1.0, 2.0]),
                                                                               reduction=r),
            "gaussian": lambda a, b, v, c, r: fusedloss.gaussian_nll_loss(a, b.expand(a.shape) * 1, v, reduction=r),
            "poisson": lambda a, b, v, c, r: fusedloss.poisson_nll_loss(a, c, reduction=r),
        }
        for (name, call), reduction, dim in itertools.product(calls.items(), ["none", "mean", "sum"], [0, 1]):
            try:
                full = [t.clone().requires_grad_(i == 0) for i, t in enumerate((x, y, var, counts))]
                dx = distribute_tensor(x, mesh, [Shard(dim)]).requires_grad_()
                sharded = [dx] + [distribute_tensor(t, mesh, [Shard(dim)]) for t in (y, var, counts)]
                out, expected = call(*sharded, reduction), call(*full, reduction)
                torch.testing.assert_close(out.full_tensor(), expected, rtol=2e-5, atol=2e-6)
                g = torch.randn(expected.shape, generator=torch.Generator(expected.device).manual_seed(1),
                                device=expected.device)
                got, = torch.autograd.grad((out.full_tensor() * g).sum(), dx)
                want, = torch.autograd.grad((expected * g).sum(), full[0])
                torch.testing.assert_close(got.full_tensor(), want, rtol=2e-5, atol=2e-6)
            except Exception as error:  # each failure is a result; the ranks keep in step
                failures.append(f"{name} {reduction} Shard({dim}): {type(error).__name__}: {str(error)[:400]}")


def _likelihood_worker(rank, device, init_file, results_dir):
    """The Gaussian and Poisson NLLs of operands of one shape on DTensors take the fused pass:
    placed alike, the one-GPU path on the local shards; a var placed otherwise, the fused
    operators through their rules (each checked by the autograd node). Against full tensors,
    values and the gradients of input, target and var, sharded unevenly along each dimension
    or replicated, every reduction, with and without ``full``, a number scale too; a double
    backward of the local route."""
    with _two_ranks(rank, device, init_file, results_dir) as (mesh, failures):
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        import fusedloss
        x, y, var = torch.randn(SHAPE), torch.randn(SHAPE), torch.rand(SHAPE) + 0.5
        counts = torch.poisson(torch.rand(SHAPE) * 4)
        calls = {
            "gaussian": lambda a, b, v, r, full, s: fusedloss.gaussian_nll_loss(a, b, v, full=full, reduction=r,
                                                                               scale=s),
            "poisson": lambda a, b, v, r, full, s: fusedloss.poisson_nll_loss(a, b, full=full, reduction=r, scale=s),
            "poisson rate": lambda a, b, v, r, full, s: fusedloss.poisson_nll_loss(a.abs(), b, log_input=False,
                                                                                  full=full, reduction=r, scale=s),
        }
        # (the operands' placement, var's)
        layouts = [(p, p) for p in (Shard(0), Shard(1), Shard(2), Replicate())] + [(Shard(1), Replicate())]
        for (name, call), reduction, (placement, var_placement), full, scale in itertools.product(
                calls.items(), ["none", "mean", "sum"], layouts, [False, True], [None, 0.5]):
            try:
                target = y if name == "gaussian" else counts
                full_leaves = [t.clone().requires_grad_() for t in (x, target, var)]
                sharded = [distribute_tensor(t, mesh, [where]).requires_grad_()
                           for t, where in zip((x, target, var), (placement, placement, var_placement))]
                out, expected = call(*sharded, reduction, full, scale), call(*full_leaves, reduction, full, scale)
                if name == "gaussian" and var_placement != placement:
                    node = "FusedLikelihoodPointwiseBackward" if reduction == "none" else "FusedLikelihoodBackward"
                else:
                    node = "_LossOfShardsBackward"
                assert out.grad_fn.name() == node, out.grad_fn.name()
                torch.testing.assert_close(out.full_tensor(), expected, rtol=2e-5, atol=2e-5)
                g = torch.randn(expected.shape, generator=torch.Generator(expected.device).manual_seed(1),
                                device=expected.device)
                wrt = 3 if name == "gaussian" else 2
                got = torch.autograd.grad((out.full_tensor() * g).sum(), sharded[:wrt])
                want = torch.autograd.grad((expected * g).sum(), full_leaves[:wrt])
                for a, b, leaf in zip(got, want, sharded):
                    # (a replicated var's gradient through DTensor's redistribution is its own)
                    assert a.placements == leaf.placements or leaf is sharded[2], (a.placements, leaf.placements)
                    torch.testing.assert_close(a.full_tensor(), b, rtol=2e-5, atol=2e-5, equal_nan=True)
                # a double backward (not through the rate's abs: DTensor's own double backward of abs
                # fails, "set the storage of a tensor on device meta")
                if var_placement == placement == Shard(0) and not full and scale is None and name != "poisson rate":
                    slopes = torch.autograd.grad((call(*sharded, reduction, full, scale).full_tensor() * g).sum(),
                                                 sharded[:wrt], create_graph=True)
                    full_slopes = torch.autograd.grad((call(*full_leaves, reduction, full, scale) * g).sum(),
                                                      full_leaves[:wrt], create_graph=True)
                    second, = torch.autograd.grad(sum((s.full_tensor() ** 2).sum() for s in slopes), sharded[0])
                    full_second, = torch.autograd.grad(sum((s ** 2).sum() for s in full_slopes), full_leaves[0])
                    torch.testing.assert_close(second.full_tensor(), full_second, rtol=2e-5, atol=2e-5)
            except Exception as error:  # each failure is a result; the ranks keep in step
                failures.append(f"{name} {reduction} {placement} {var_placement} full={full} scale={scale}: "
                                f"{type(error).__name__}: {str(error)[:400]}")


def _unfused_worker(rank, device, init_file, results_dir):
    """Where the kernels do not apply (on the CPU without fusedloss's operators, under
    torch.compile, a torch.func transform, an unsupported dtype), a DTensor goes to torch
    operations: against full tensors, unevenly sharded, every loss and reduction, with and
    without a weight and a scale. DTensor's own rules for PyTorch's loss operators average
    the ranks' means, which over uneven shards is not the mean: this fails if the route
    hands them a mean."""
    with _two_ranks(rank, device, init_file, results_dir) as (mesh, failures):
        from torch.distributed.tensor import Shard, distribute_tensor

        from conftest import LOSSES, PARAMS
        from fusedloss import routing

        routing.kernels_apply = lambda input, target: False
        x, y, w = torch.randn(7, 5, 3) * 2, torch.randn(7, 5, 3) * 2, torch.rand(7, 5, 3) + 0.25
        for (name, (fn, _, keyword)), reduction, (weighted, scale) in itertools.product(
                LOSSES.items(), ["none", "mean", "sum"], [(False, None), (True, None), (False, 0.5)]):
            try:
                kwargs = dict(reduction=reduction, scale=scale, **({keyword: PARAMS[name]} if keyword else {}))
                full_x = x.clone().requires_grad_()
                dx = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
                dy = distribute_tensor(y, mesh, [Shard(0)])
                out = fn(dx, dy, weight=distribute_tensor(w, mesh, [Shard(0)]) if weighted else None, **kwargs)
                expected = fn(full_x, y, weight=w if weighted else None, **kwargs)
                torch.testing.assert_close(out.full_tensor(), expected, rtol=2e-5, atol=2e-6)
                g = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), device="cpu")
                g = g.to(expected.device)
                got, = torch.autograd.grad((out.full_tensor() * g).sum(), dx)
                want, = torch.autograd.grad((expected * g).sum(), full_x)
                torch.testing.assert_close(got.full_tensor(), want, rtol=2e-5, atol=2e-6)
            except Exception as error:  # each failure is a result; the ranks keep in step
                failures.append(f"{name} {reduction} weighted={weighted} scale={scale}: {type(error).__name__}: "
                                f"{str(error)[:400]}")


def _cache_worker(rank, device, init_file, results_dir):
    """Calls alike in their DTensor operands and unlike in the rest (which gradients are
    asked for, which optional operands are given, the loss): each gets its own placements
    from DTensor's cache of decisions, so each matches the full tensors. Through the
    operators (the local shards' route would take these calls without DTensor's dispatch)."""
    with _two_ranks(rank, device, init_file, results_dir) as (mesh, failures):
        from torch.distributed.tensor import Shard, distribute_tensor

        import fusedloss
        from fusedloss import sharding
        sharding.on_local_shards = lambda *args: None
        x, y, w = torch.randn(6, 5), torch.randn(6, 5), torch.rand(6, 5) + 0.5
        calls = [("mse", "mean", False, None), ("mse", "mean", True, None), ("mse", "sum", True, w),
                 ("mse", "sum", False, w), ("l1", "sum", True, None), ("l1", "none", True, None)]
        for name, reduction, target_grad, weight in calls:
            fn = getattr(fusedloss, LOSSES[name][0].__name__)
            dx = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
            dy = distribute_tensor(y, mesh, [Shard(0)]).requires_grad_(target_grad)
            dw = None if weight is None else distribute_tensor(weight, mesh, [Shard(0)])
            fx, fy = x.clone().requires_grad_(), y.clone().requires_grad_(target_grad)
            out, expected = fn(dx, dy, reduction=reduction, weight=dw), fn(fx, fy, reduction=reduction, weight=weight)
            try:
                torch.testing.assert_close(out.full_tensor(), expected)
                wrt = (dx, dy) if target_grad else (dx,)
                got = torch.autograd.grad(out.full_tensor().sum(), wrt)
                want = torch.autograd.grad(expected.sum(), (fx, fy) if target_grad else (fx,))
                for a, b in zip(got, want):
                    torch.testing.assert_close(a.full_tensor(), b)
            except Exception as error:  # each failure is a result; the ranks keep in step
                failures.append(f"{name} {reduction} target grad {target_grad} weight {weight is not None}: "
                                f"{type(error).__name__}: {str(error)[:300]}")


def _per_sample_worker(rank, device, init_file, results_dir):
    """The per-sample operator on operands sharded along a kept or a reduced dimension, or
    replicated, against full tensors, values and gradients."""
    with _two_ranks(rank, device, init_file, results_dir) as (mesh, failures):
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        from fusedloss import sharding  # noqa: F401  (registers the operators' rules)
        op = torch.ops.fusedloss.per_sample_loss.default
        x, y = torch.randn(7, 5, 8), torch.randn(7, 5, 8)
        for placement, reduction, loss in itertools.product([Shard(0), Shard(1), Shard(2), Replicate()],
                                                            ["mean", "sum"], ["mse", "huber"]):
            try:
                fx = x.clone().requires_grad_()
                dx = distribute_tensor(x, mesh, [placement]).requires_grad_()
                dy = distribute_tensor(y, mesh, [placement])
                out, expected = op(dx, dy, loss, 1.0, 1, reduction), op(fx, y, loss, 1.0, 1, reduction)
                assert out.shape == expected.shape == (7,)
                torch.testing.assert_close(out.full_tensor(), expected)
                g = torch.randn(expected.shape, generator=torch.Generator(expected.device).manual_seed(1),
                                device=expected.device)
                got, = torch.autograd.grad((out.full_tensor() * g).sum(), dx)
                want, = torch.autograd.grad((expected * g).sum(), fx)
                torch.testing.assert_close(got.full_tensor(), want)
            except Exception as error:  # each failure is a result; the ranks keep in step
                failures.append(f"{loss} {reduction} {placement}: {type(error).__name__}: {str(error)[:300]}")


def _graph_worker(rank, device, init_file, results_dir):
    """The local shards' route as autograd sees it: its saved graph freed by a backward that
    does not retain it, a retained graph's second backward, and a double backward, against
    full tensors (float64, unevenly sharded; a weighted mean besides)."""
    with _two_ranks(rank, device, init_file, results_dir) as (mesh, failures):
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        import fusedloss
        from fusedloss import sharding
        taken = []
        on_local_shards = sharding.on_local_shards
        sharding.on_local_shards = lambda *args: (lambda out: out if out is None else taken.append(1) or out)(
            on_local_shards(*args))
        x, y, g = (torch.randn(7, 5, dtype=torch.float64) for _ in range(3))
        w = torch.rand(7, 5, dtype=torch.float64) + 0.25
        cases = [("mean", False), ("sum", False), ("none", False), ("mean", True)]
        for reduction, weighted in cases:
            try:
                dx = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
                dy, dg, dw = (distribute_tensor(t, mesh, [Shard(0)]) for t in (y, g, w))

                def scalar(a, b, g):
                    weight = (dw if isinstance(a, DTensor) else w) if weighted else None
                    out = fusedloss.smooth_l1_loss(a * 1, b, beta=0.7, reduction=reduction, weight=weight)
                    # a term beside the loss, so that a second derivative missing the loss's part
                    # is a wrong value rather than an input the graph does not use
                    return out, (out if reduction != "none" else (out * g).sum()) + (a * a * a).sum() / 8

                out, loss = scalar(dx, dy, dg)
                node = out.grad_fn
                saves = len(node.saved_tensors) > 0
                first = torch.autograd.grad(loss, dx, retain_graph=True)[0]
                second = torch.autograd.grad(loss, dx)[0]
                assert torch.equal(first.full_tensor(), second.full_tensor()), "retained graph"
                try:  # what the loss's node saved, autograd has freed
                    assert not (saves and node.saved_tensors), "saved tensors outlive a backward"
                except RuntimeError:
                    pass
                kept = [name for name, value in getattr(node, "__dict__", {}).items()
                        if any(isinstance(v, torch.Tensor) for v in (value if isinstance(value, tuple) else (value,)))]
                assert not kept, f"the loss's node keeps tensors past its backward: {kept}"
                fx = x.clone().requires_grad_()
                torch.testing.assert_close(first.full_tensor(), torch.autograd.grad(scalar(fx, y, g)[1], fx)[0])
                try:
                    slope, = torch.autograd.grad(scalar(dx, dy, dg)[1], dx, create_graph=True)
                except NotImplementedError:  # a weight's gradient differentiates PyTorch's formula:
                    try:  # on torch 2.10 DTensor has no rule for it, and raises as F does
                        torch.nn.functional.smooth_l1_loss(dx.detach(), dy, beta=0.7)
                    except NotImplementedError:
                        continue
                    raise
                curvature, = torch.autograd.grad((slope * slope).sum(), dx)
                full_slope, = torch.autograd.grad(scalar(fx, y, g)[1], fx, create_graph=True)
                full_curvature, = torch.autograd.grad((full_slope * full_slope).sum(), fx)
                torch.testing.assert_close(curvature.full_tensor(), full_curvature)
            except Exception as error:  # each failure is a result; the ranks keep in step
                failures.append(f"{reduction} weighted={weighted}: {type(error).__name__}: {str(error)[:300]}")
        if len(taken) != 2 * len(cases):
            failures.append(f"the local shards' route took {len(taken)} of {2 * len(cases)} calls")
        _one_cpp_node_case(mesh, x, y, failures)


def _one_cpp_node_case(mesh, x, y, failures):
    """The local shards' graph as one C++ node (PyTorch's own loss node, as the C++ autograd's
    are): backward() calls that node; torch.autograd.grad(..., inputs), whose graph task never
    heard of the shards' leaves, gets its gradients all the same."""
    from torch.distributed.tensor import Partial, Shard, distribute_tensor

    from fusedloss import sharding

    def local_loss(i, t):
        return torch.nn.functional.mse_loss(i, t, reduction="sum")

    arguments = (local_loss, None, (Partial(),), torch.Size(()), ())
    grads = {"input": 2 * (x - y), "target": 2 * (y - x)}
    try:
        i, t = (torch.randn(3, requires_grad=True) for _ in range(2))
        assert sharding._one_node_over(local_loss(i, t), (i, t)) is not None, "not one node"
        for call in ("backward", "grad of input", "grad of both"):
            dx, dy = (distribute_tensor(v, mesh, [Shard(0)]).requires_grad_() for v in (x, y))
            out = sharding._LossOfShards.apply(arguments, dx, dy)
            if call == "backward":
                out.backward()
                got = {"input": dx.grad, "target": dy.grad}
            elif call == "grad of input":
                got = {"input": torch.autograd.grad(out, dx)[0]}
            else:
                got = dict(zip(("input", "target"), torch.autograd.grad(out, (dx, dy))))
            for name, grad in got.items():
                torch.testing.assert_close(grad.full_tensor(), grads[name], msg=lambda m: f"{call}, {name}: {m}")
    except Exception as error:
        failures.append(f"one C++ node: {type(error).__name__}: {str(error)[:300]}")


@pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
def test_a_none_loss_is_described_with_the_strides_torch_gives_its_shape():
    """A sharded 'none' loss's spec holds the global loss's strides, computed as torch lays out
    a new tensor of that shape (a dimension of size 0 or 1 included)."""
    from fusedloss import sharding

    rng = random.Random()
    shapes = [(), (0,), (5,), (1, 1), (4, 0), (3, 0, 2), (7, 1, 3)]
    shapes += [tuple(rng.choice([0, 1, 2, 3, 17]) for _ in range(rng.randint(1, 5))) for _ in range(20)]
    for shape in shapes:
        assert sharding._contiguous_strides(torch.Size(shape)) == torch.empty(shape, device="meta").stride(), shape


@pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
@pytest.mark.parametrize("device", DEVICES)
def test_the_local_shards_graph_is_freed_retained_and_differentiated_twice(tmp_path, device):
    _spawn_two_ranks(_graph_worker, device, tmp_path)


@pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
@pytest.mark.parametrize("device", DEVICES)
def test_the_per_sample_operator_takes_dtensors(tmp_path, device):
    _spawn_two_ranks(_per_sample_worker, device, tmp_path)


@pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
@pytest.mark.parametrize("device", DEVICES)
def test_calls_unlike_in_non_tensor_arguments_get_their_own_placements(tmp_path, device):
    _spawn_two_ranks(_cache_worker, device, tmp_path)


@pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
@pytest.mark.parametrize("device", DEVICES)
def test_the_losses_beside_the_table_take_dtensors(tmp_path, device):
    _spawn_two_ranks(_other_losses_worker, device, tmp_path)


@pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
@pytest.mark.parametrize("device", DEVICES)
def test_the_nlls_take_their_fused_pass_on_dtensors(tmp_path, device):
    _spawn_two_ranks(_likelihood_worker, device, tmp_path)


@pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
@pytest.mark.parametrize("device", DEVICES)
def test_a_mean_over_uneven_shards_is_the_mean_where_torch_operations_compute_it(tmp_path, device):
    _spawn_two_ranks(_unfused_worker, device, tmp_path)


def _served_worker(rank, device, init_file, results_dir):
    """DTensor's own operator serves the small steps of the losses PyTorch computes with a
    kernel of its own where its result is exact ('none' and sums, even or uneven shards),
    without loading the weighted kernels;
    means (whose gradient DTensor's rules give times the number of shards), L1 (whose rule
    gathers the operands) and fusedloss's own losses take the local shards' route. Values
    and gradients against full tensors."""
    with _two_ranks(rank, device, init_file, results_dir) as (mesh, failures):
        from torch.distributed.tensor import Shard, distribute_tensor

        from conftest import LOSSES, PARAMS, PYTORCH_SERVES_THE_STEP, loss_kwargs
        from fusedloss import build, routing, sharding
        routing.pytorch_serves_the_step = PYTORCH_SERVES_THE_STEP
        taken, families = [], []
        on_local_shards, use_kernels = sharding.on_local_shards, build.use_kernels
        sharding.on_local_shards = lambda *args: taken.append(1) or on_local_shards(*args)
        build.use_kernels = lambda *args: families.extend(args) or use_kernels(*args)
        cases = [(8, "mse", "sum", False), (7, "huber", "sum", False), (7, "smooth_l1", "none", False),
                 (8, "mse", "mean", True), (7, "smooth_l1", "mean", True), (8, "l1", "sum", True),
                 (8, "log_cosh", "sum", True)]
        for rows, name, reduction, local_route in cases:
            try:
                taken.clear()
                families.clear()
                x, y, g = (torch.randn(rows, 5, dtype=torch.float64) * 2 for _ in range(3))
                dx = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
                dy, dg = (distribute_tensor(t, mesh, [Shard(0)]) for t in (y, g))
                function, kwargs = LOSSES[name][0], loss_kwargs(name, PARAMS[name])
                out = function(dx, dy, reduction=reduction, **kwargs)
                ((out * dg).sum() if reduction == "none" else out * 0.37).backward()
                fx = x.clone().requires_grad_()
                expected = function(fx, y, reduction=reduction, **kwargs)
                ((expected * g).sum() if reduction == "none" else expected * 0.37).backward()
                assert bool(taken) == local_route, f"the local shards' route taken: {bool(taken)}"
                # DTensor's own operator needs no kernels of fusedloss's (a source build compiles none)
                assert local_route or "weighted" not in families, families
                torch.testing.assert_close(out.full_tensor(), expected.detach(), msg="value")
                torch.testing.assert_close(dx.grad.full_tensor(), fx.grad, msg="gradient")
            except Exception as error:  # each failure is a result; the ranks keep in step
                failures.append(f"{rows} {name} {reduction}: {type(error).__name__}: {str(error)[:300]}")


@pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
@pytest.mark.parametrize("device", DEVICES)
def test_dtensors_own_operator_serves_small_steps_where_it_is_exact(tmp_path, device):
    _spawn_two_ranks(_served_worker, device, tmp_path)


def _autocast_worker(rank, device, init_file, results_dir):
    """Under autocast, 16-bit DTensor operands against the same call on full tensors: every
    loss and reduction, plain, weighted and scaled, unevenly sharded; the loss in autocast's
    dtype (float32: these losses are on its float32 list) and each gradient in its operand's."""
    with _two_ranks(rank, device, init_file, results_dir) as (mesh, failures):
        from torch.distributed.tensor import Shard, distribute_tensor

        from conftest import LOSSES, PARAMS, loss_kwargs
        from fusedloss import routing

        if device == "cpu":  # the route CPU tensors take (the operators' CPU kernels know CUDA's autocast only)
            routing.kernels_apply = lambda input, target: False
        x, y, w = torch.randn(7, 5, 3) * 2, torch.randn(7, 5, 3) * 2, torch.rand(7, 5, 3) + 0.25
        x, y = x.to(torch.bfloat16), y.to(torch.bfloat16)
        for name, reduction, (weighted, scale) in itertools.product(
                LOSSES, ["none", "mean", "sum"], [(False, None), (True, None), (False, 0.5)]):
            try:
                function, kwargs = LOSSES[name][0], loss_kwargs(name, PARAMS[name])
                kwargs.update(reduction=reduction, scale=scale)
                full_x = x.clone().requires_grad_()
                dx = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
                dy = distribute_tensor(y, mesh, [Shard(0)])
                dw = distribute_tensor(w, mesh, [Shard(0)]) if weighted else None
                with torch.autocast(device, dtype=torch.bfloat16):
                    out = function(dx, dy, weight=dw, **kwargs)
                    expected = function(full_x, y, weight=w if weighted else None, **kwargs)
                assert out.dtype == expected.dtype == torch.float32, (out.dtype, expected.dtype)
                torch.testing.assert_close(out.full_tensor(), expected, rtol=2e-5, atol=2e-6, msg="value")
                g = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), device="cpu")
                got, = torch.autograd.grad((out.full_tensor() * g.to(expected.device)).sum(), dx)
                want, = torch.autograd.grad((expected * g.to(expected.device)).sum(), full_x)
                assert got.dtype == want.dtype == torch.bfloat16, (got.dtype, want.dtype)
                torch.testing.assert_close(got.full_tensor(), want, msg="gradient")
            except Exception as error:  # each failure is a result; the ranks keep in step
                failures.append(f"{name} {reduction} weighted={weighted} scale={scale}: {type(error).__name__}: "
                                f"{str(error)[:400]}")


@pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
@pytest.mark.parametrize("device", DEVICES)
def test_sharded_losses_under_autocast_match_full_tensors(tmp_path, device):
    _spawn_two_ranks(_autocast_worker, device, tmp_path)


def _cuda_graph_worker(rank, device, init_file, results_dir):
    """A sharded step captured in a CUDA graph, then replayed on new operands: its loss and
    gradient against eager full tensors, for every loss, a mean and a sum, unevenly sharded."""
    with _two_ranks(rank, device, init_file, results_dir) as (mesh, failures):
        from torch.distributed.tensor import Shard, distribute_tensor

        from conftest import LOSSES, PARAMS, loss_kwargs

        for name, reduction in itertools.product(LOSSES, ["mean", "sum"]):
            try:
                function, kwargs = LOSSES[name][0], loss_kwargs(name, PARAMS[name])
                x, y = torch.randn(7, 5, 3) * 2, torch.randn(7, 5, 3) * 2
                dx = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
                dy = distribute_tensor(y, mesh, [Shard(0)])
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graphs asks
                    for _ in range(3):
                        dx.grad = None
                        function(dx, dy, reduction=reduction, **kwargs).backward()
                torch.cuda.current_stream().wait_stream(side)
                dx.grad = None
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = function(dx, dy, reduction=reduction, **kwargs)
                    out.backward()
                for _ in range(2):
                    x, y = torch.randn(7, 5, 3) * 2, torch.randn(7, 5, 3) * 2
                    with torch.no_grad():
                        dx.to_local().copy_(distribute_tensor(x, mesh, [Shard(0)]).to_local())
                        dy.to_local().copy_(distribute_tensor(y, mesh, [Shard(0)]).to_local())
                    graph.replay()
                    full_x = x.clone().requires_grad_()
                    expected = function(full_x, y, reduction=reduction, **kwargs)
                    expected.backward()
                    torch.testing.assert_close(out.full_tensor(), expected.detach(), rtol=2e-5, atol=2e-6,
                                               msg="value")
                    torch.testing.assert_close(dx.grad.full_tensor(), full_x.grad, rtol=2e-5, atol=2e-6,
                                               msg="gradient")
            except Exception as error:  # each failure is a result; the ranks keep in step
                failures.append(f"{name} {reduction}: {type(error).__name__}: {str(error)[:400]}")


@pytest.mark.skipif(not dist.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_sharded_step_captured_in_a_cuda_graph_replays_as_eager(tmp_path):
    _spawn_two_ranks(_cuda_graph_worker, "cuda", tmp_path)


@pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
@pytest.mark.parametrize("device", DEVICES)
def test_sharded_losses_match_full_tensors(tmp_path, device):
    world = MESHES[device][0][0]
    torch.multiprocessing.spawn(_worker, args=(device, str(tmp_path / "init"), str(tmp_path)), nprocs=world)
    for rank in range(world):
        counts, *failures = (tmp_path / f"rank{rank}.txt").read_text().split("\n", 1)
        count, local = map(int, counts.split())
        assert count == (2 * 4 + 2) * len(LOSSES) * 3
        print(f"rank {rank}: {local} of {count} cases on the local shards' route")
        assert local > count // 10  # the common cases take it
        assert not "".join(failures).strip(), f"rank {rank}:\n" + "".join(failures)[:6000]


def _training_worker(rank, device, init_file, results_dir):
    """20 SGD steps of a column-parallel Linear whose output stays a DTensor sharded on its
    last dimension, evenly (20 outputs) and unevenly (21): the loss with fusedloss (its
    sharded route), with torch.nn.functional on the DTensors (DTensor's own rules), and with
    torch.nn.functional on one rank's unsharded model, all from the same start."""
    with process_group(rank, 2, init_file, device):
        from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        from conftest import cpu_through_operators

        import fusedloss
        from fusedloss import sharding
        if device == "cpu":
            cpu_through_operators()
        used = []
        sharded_loss, on_local_shards = sharding.sharded_loss, sharding.on_local_shards
        sharding.sharded_loss = lambda *args: used.append(1) or sharded_loss(*args)
        sharding.on_local_shards = lambda *args: (lambda out: out if out is None else used.append(1) or out)(
            on_local_shards(*args))
        mesh = init_device_mesh(device, (2,))
        lines = []
        for outputs in (20, 21):
            losses = {}
            for name, loss_fn, parallel in (("fusedloss", fusedloss.mse_loss, True),
                                            ("F", torch.nn.functional.mse_loss, True),
                                            ("unsharded", torch.nn.functional.mse_loss, False)):
                torch.manual_seed(0)
                model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                            torch.nn.Linear(32, outputs)).to(device)
                if parallel:
                    parallelize_module(model, mesh, {"2": ColwiseParallel(output_layouts=Shard(-1),
                                                                          use_local_output=False)})
                # one update per tensor: CUDA's foreach default would mix DTensors and tensors
                optimizer = torch.optim.SGD(model.parameters(), lr=0.2, foreach=False)
                losses[name] = []
                teacher = (torch.randn(16, outputs, generator=torch.Generator().manual_seed(100)) / 4).to(device)
                for step in range(20):
                    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).to(device)
                    y = x @ teacher  # a target the model can learn
                    try:
                        loss = loss_fn(model(x), distribute_tensor(y, mesh, [Shard(-1)]) if parallel else y)
                    except NotImplementedError:  # before torch 2.11, DTensor has no rule for aten.mse_loss
                        assert name == "F"
                        losses[name] = [math.nan] * 20
                        break
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    losses[name].append(loss.full_tensor().item() if parallel else loss.item())
            lines += [f"{outputs} {a!r} {b!r} {c!r}" for a, b, c in zip(*losses.values())]
        (Path(results_dir) / f"rank{rank}.txt").write_text("\n".join([str(len(used))] + lines))


@pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
@pytest.mark.parametrize("device", DEVICES)
def test_a_tensor_parallel_loop_trains_as_with_torch(tmp_path, device):
    """fusedloss's loop matches the unsharded one, evenly and unevenly sharded. Its first
    loss is also DTensor's own for even shards; unevenly, DTensor averages the shards'
    means. (From the second step on, DTensor's own loop departs from the unsharded one on
    torch 2.13: the sharded operands' gradient differs; fusedloss's does not.)"""
    torch.multiprocessing.spawn(_training_worker, args=(device, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    for rank in range(2):
        used, *rows = (tmp_path / f"rank{rank}.txt").read_text().split("\n")
        assert int(used) == 40  # every step through the fused, sharded route
        table = torch.tensor([[float(v) for v in row.split()] for row in rows], dtype=torch.float64)
        for outputs in (20, 21):
            ours, theirs, unsharded = table[table[:, 0] == outputs, 1:].T
            assert len(ours) == 20 and ours[-5:].mean() < ours[:5].mean()
            torch.testing.assert_close(ours, unsharded, rtol=1e-5, atol=1e-6)
            # DTensor's uneven mean is the mean of means (NaN: no DTensor rule on this torch)
            assert abs(theirs[0] - unsharded[0]) < 1e-5 or outputs == 21 or theirs[0].isnan()
