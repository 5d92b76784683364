"""``python -m decoding.quant.native``: build the kernels now (scripts/setup.sh), say which and where."""

import sys

from decoding.quant.native import KernelUnavailable, build, variant

try:
    path = build()
except KernelUnavailable as exc:
    print(f"integer kernels: {exc}", file=sys.stderr)
    sys.exit(1)
print(f"integer kernels: {variant()[0]} build at {path}")
