"""The GPU check: what a GPU proves in minutes that the CPU tiers cannot (docs/gpu_check.md).

    python scripts/gpu_check.py [--device cuda|cpu] [--out DIR] [--work DIR] [--budget-s S]
                                [--stages a,b] [--skip a,b] [--colocated-push MODULE:FUNCTION]

On a GPU machine without a package registry (one H200, Python 3.12, torch 2.11; see
docs/gpu_check.md): ``bash scripts/device/gpu_check.sh`` (unpacks the device bundle, then
runs this with ``--device cuda --out $OUT``). ``--device cpu`` runs every stage's code
path at tiny sizes on the CPU, so that a GPU run cannot die on a typo. The stages and the
report: ``bench/gpu/`` (``bench.gpu.check``).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a file on a machine where fleetrl is not installed
    sys.path.insert(0, str(REPO))

from bench.gpu.check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
