"""Command line: ``python -m fusedloss {build,info,bench} ...`` and ``--version``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _build(arch: str | None, force: bool, families: list[str]) -> int:
    import torch

    from . import build

    start = time.perf_counter()
    try:
        libraries = build.build(arch, force=force, families=families)
    except (build.KernelsUnavailableError, ValueError) as error:
        print(f"fusedloss build failed: {error}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    print(f"fusedloss kernels ({', '.join(libraries)}) for compute capability {', '.join(build.arch_list(arch))} "
          f"(torch {torch.__version__}, CUDA {torch.version.cuda}) ready in {seconds:.1f} s")
    for family, library in libraries.items():
        print(f"{family}: {library}, compiled with: {build.compiler_of(library)}")
    registered = build.registered_ops()
    wanted = [op for family in libraries for op in build.FAMILIES[family].ops]
    missing = sorted(set(wanted) - set(registered))
    print(f"CUDA kernels registered: {', '.join(f'fusedloss::{op}' for op in registered) or 'none'}")
    if "plain" in libraries:
        print(f"C++ autograd: {'loaded' if build.cxx_autograd_loaded() else 'not loaded (the Python autograd serves)'}")
    if missing:
        print(f"fusedloss build failed: no CUDA kernel registered for {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


def _info() -> int:
    import torch

    from . import __version__, build

    print(f"fusedloss {__version__}; torch {torch.__version__}, CUDA {torch.version.cuda or 'none (a CPU build)'}")
    archs = build.arch_list()
    if not torch.cuda.is_available():
        print("GPU: none visible; CUDA tensors cannot run here, and CPU tensors run torch.nn.functional")
        capabilities = [build._capability(a) for a in archs]
    else:
        capabilities = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        print(f"GPU: {', '.join(names)}, compute capability "
              f"{', '.join(sorted({f'{major}.{minor}' for major, minor in capabilities}))}")
    for family in build.FAMILIES:
        print(f"{family} kernels: {build.kernel_source(family, archs, capabilities)}")
    library = build.cxx_autograd_library()
    print(f"C++ autograd: {'cached in ' + str(library.parent) if library.exists() else 'not built (python -m fusedloss build compiles it)'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from . import __version__, build

    parser = argparse.ArgumentParser(prog="python -m fusedloss")
    parser.add_argument("--version", action="version", version=f"fusedloss {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, the GPU, and where the kernels come from (wheel, cache or none)")
    build_parser = commands.add_parser(
        "build", help="compile the CUDA kernels into the cache now (no GPU needed with --arch) and load them")
    build_parser.add_argument("--arch", help="compute capabilities, e.g. 9.0 or '8.0;9.0+PTX' (default: "
                                             "TORCH_CUDA_ARCH_LIST, else the visible GPUs)")
    build_parser.add_argument("--force", action="store_true", help="build again, also after a recorded failure")
    build_parser.add_argument("--family", action="append", default=[],
                              choices=list(build.FAMILIES),
                              help="build only this family of kernels (repeatable; default: all)")
    bench = commands.add_parser("bench", help="check against float64 and time against eager and torch.compile")
    bench.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for the table, CSV and plot")
    bench.add_argument("--shape", type=int, nargs="+", default=[32768, 32768], help="input shape of the cases")
    bench.add_argument("--no-training", action="store_true", help="skip the forward+backward rows")
    latency = bench.add_mutually_exclusive_group()
    latency.add_argument("--no-latency", action="store_true",
                         help="skip the training-loop rows (latency table, AMP, loss / 4, compiled model)")
    latency.add_argument("--only-latency", action="store_true",
                         help="run only the training-loop rows, not the 2^30 rows")
    weighted = bench.add_mutually_exclusive_group()
    weighted.add_argument("--no-weighted", action="store_true",
                          help="skip the weighted-loss rows (weight=, scale=, pseudo-Huber)")
    weighted.add_argument("--only-weighted", action="store_true",
                          help="run only the weighted-loss rows (with --only-latency: and the training-loop rows)")
    bench.add_argument("--latency-exponents", type=int, nargs="+", metavar="K",
                       help="sizes 2^K of the latency table (default: 7 10 12 14 ... 30)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    if args.command == "build":
        return _build(args.arch, args.force, args.family)
    if args.command == "info":
        return _info()

    from . import bench as bench_module

    return bench_module.run(args.out, tuple(args.shape), with_training=not args.no_training, with_latency=not args.no_latency,
                            only_latency=args.only_latency, latency_exponents=args.latency_exponents,
                            with_weighted=not args.no_weighted, only_weighted=args.only_weighted)


if __name__ == "__main__":
    sys.exit(main())
