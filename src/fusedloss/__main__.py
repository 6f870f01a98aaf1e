"""Command line: ``python -m fusedloss {build,bench,kernelbench} ...``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["kernelbench"]:
        from . import kernelbench

        return kernelbench.main(argv[1:])

    parser = argparse.ArgumentParser(prog="python -m fusedloss")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help="compile the CUDA kernels now and print where the build went")
    bench = commands.add_parser("bench", help="check against float64 and time against eager and torch.compile")
    bench.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for the table, CSV and plot")
    bench.add_argument("--shape", type=int, nargs="+", default=[32768, 32768], help="input shape of the cases")
    bench.add_argument("--no-sweep", action="store_true", help="skip the 2^12..2^30 size sweep")
    bench.add_argument("--no-training", action="store_true", help="skip the forward+backward rows")
    commands.add_parser("kernelbench", help="export or evaluate the KernelBench files (see its --help)")
    args = parser.parse_args(argv)

    if args.command == "build":
        import torch

        from . import build

        if not torch.cuda.is_available():
            print("fusedloss build: no CUDA device, nothing to build for.")
            return 1
        start = time.perf_counter()
        try:
            library = build.load()
        except build.KernelsUnavailableError as error:
            print(f"fusedloss build failed: {error}")
            return 1
        print(f"fusedloss kernels ready in {time.perf_counter() - start:.1f} s: {library}")
        return 0

    from . import bench as bench_module

    return bench_module.run(args.out, tuple(args.shape), with_sweep=not args.no_sweep,
                            with_training=not args.no_training)


if __name__ == "__main__":
    sys.exit(main())
