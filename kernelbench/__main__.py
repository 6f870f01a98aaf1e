"""``python -m kernelbench {export,eval}``, run from the repository root."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from .evaluate import INPUT_MODES, evaluate


def main(argv: Sequence[str] | None = None) -> int:
    """``kernelbench export DIR`` and ``kernelbench eval REF.py NEW.py [...]``; returns the exit status.

    eval exits 0 when every evaluation passed, 1 when one failed, and 2 when
    no CUDA GPU is visible (nothing can be evaluated then).
    """
    parser = argparse.ArgumentParser(
        prog="python -m kernelbench", description="KernelBench ModelNew files and their evaluation."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    export_parser = commands.add_parser("export", help="write the self-contained ModelNew files into DIR")
    export_parser.add_argument("directory", type=Path, metavar="DIR")
    eval_parser = commands.add_parser("eval", help="judge NEW.py against the reference problem REF.py (needs a GPU)")
    eval_parser.add_argument("reference", type=Path, metavar="REF.py")
    eval_parser.add_argument("new", type=Path, metavar="NEW.py")
    eval_parser.add_argument("--inputs", choices=(*INPUT_MODES, "both"), default="rand")
    eval_parser.add_argument("--trials", type=int, default=5, help="correctness trials (default 5)")
    eval_parser.add_argument("--timing-trials", type=int, default=100, help="timed calls per model (default 100)")
    args = parser.parse_args(argv)

    if args.command == "export":
        from .export import export  # needs fusedloss; eval does not

        for path in export(args.directory):
            print(path)
        return 0
    if not torch.cuda.is_available():
        print("kernelbench eval needs a CUDA GPU, and none is visible: nothing was evaluated.")
        return 2
    modes = INPUT_MODES if args.inputs == "both" else (args.inputs,)
    results = [
        evaluate(args.reference, args.new, inputs=mode, trials=args.trials, timing_trials=args.timing_trials)
        for mode in modes
    ]
    return 0 if all(result.passed for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
