"""Runs torch_cppwrap's benchmark: same as ``python -m torch_cppwrap bench``.

python benchmarks/bench.py [--workloads seed,mlp] [--modes python,cppwrap] [--quick]
"""

import sys

from torch_cppwrap._bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
