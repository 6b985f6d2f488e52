"""Do frozen compiles of one shape in one process each tune their pointwise
kernels, or does a later one read the best config an earlier one saved?

    python scripts/gpu/retune_check.py [pin] [python]

Compiles three two-layer frozen MLPs of one shape in turn and prints, per
compile, how often each kernel ran `CachingAutotuner.benchmark_all_configs`
and how many new `wrapper.cpp` files (libraries of ours) the cache got.
`pin` sets `triton.autotune_pointwise=False`; `python` compiles with the
Python wrapper instead of ours. Session 48, each wrapper in a fresh
Inductor cache: the Python wrapper tuned at every compile, ours once, then
read the `.best_config` back (session 47's re-tuning is Inductor's).
"""

import collections
import glob
import sys

import torch
import torch_cppwrap  # noqa: F401
from torch._inductor import config
from torch._inductor.runtime import triton_heuristics
from torch._inductor.runtime.cache_dir_utils import cache_dir

calls: collections.Counter[str] = collections.Counter()
original = triton_heuristics.CachingAutotuner.benchmark_all_configs


def counted(self, *args, **kwargs):
    calls[self.fn.__name__] += 1
    timings = original(self, *args, **kwargs)
    picks = {str(getattr(k, "config", k)): round(v, 4) for k, v in timings.items()}
    print("  tuned", self.fn.__name__, picks)
    return timings


triton_heuristics.CachingAutotuner.benchmark_all_configs = counted

pin = "pin" in sys.argv[1:]
ours = "python" not in sys.argv[1:]
x = torch.randn(8, 32, device="cuda")
cache = cache_dir()
settings = {
    "freezing": True,
    "cpp_wrapper": ours,
    "fx_graph_cache": False,
    "triton.autotune_pointwise": not pin,
}
with config.patch(settings), torch.no_grad():
    for i in range(3):
        layers = [torch.nn.Linear(32, 32), torch.nn.ReLU()] * 2
        model = torch.nn.Sequential(*layers).cuda().eval()
        calls.clear()
        before = set(glob.glob(f"{cache}/**/wrapper.cpp", recursive=True))
        out = torch.compile(model)(x)
        torch.testing.assert_close(out, model(x), atol=1e-3, rtol=1e-3)
        new = set(glob.glob(f"{cache}/**/wrapper.cpp", recursive=True)) - before
        best = glob.glob(f"{cache}/**/*.best_config", recursive=True)
        print(
            f"compile {i}: benchmark_all_configs {dict(calls)}; "
            f"new wrapper.cpp {len(new)}; .best_config files {len(best)}"
        )
