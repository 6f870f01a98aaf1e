"""A build that fails, then a second process: how long each takes to fall back.

Plants an `#error` in a copy of csrc/, points fusedloss at it, and runs two
processes one after the other on an empty build cache. The first compiles and
fails; the second must find the recorded failure and fall back without
compiling. Needs a GPU machine with a CUDA compiler (scripts/gpu_check.sh tests).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import time, warnings
start = time.perf_counter()
import torch
from pathlib import Path
from fusedloss import build
build.CSRC = Path({csrc!r})
imported = time.perf_counter()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    used = build.use_kernels()
done = time.perf_counter()
message = next(str(w.message) for w in caught if issubclass(w.category, build.FallbackWarning))
print(f"kernels used: {{used}}; fallback {{done - imported:.2f}} s after import ({{done - start:.2f}} s with it)")
print("  " + next((line for line in message.splitlines() if "error" in line), message.splitlines()[1]).strip())
"""


def main() -> int:
    import fusedloss.build

    work = Path(tempfile.mkdtemp())
    csrc = work / "csrc"
    shutil.copytree(fusedloss.build.CSRC, csrc)
    with open(csrc / "reduced_loss.cu", "a") as source:
        source.write('\n#error "planted by scripts/failed_build_fallback.py"\n')
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(work / "cache"))
    for label in ("first process (compiles, fails)", "second process (reads the record)"):
        print(label + ":", flush=True)
        done = subprocess.run([sys.executable, "-c", CHILD.format(csrc=str(csrc))], env=env, text=True,
                              capture_output=True)
        print(done.stdout.rstrip() or done.stderr[-2000:], flush=True)
    shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
