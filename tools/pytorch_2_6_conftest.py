"""The conftest.py that lets PyTorch 2.6.0's test/inductor files collect on a
newer torch (2.11 on the GPU machine, 2.13 to 2.15 on the CPU ones).

Those files are the newest PyTorch test files a fresh machine can fetch
whole (Debian's source package); ``tools/fetch_pytorch_tests.sh`` copies
them, never committed, to ``.pytorch_tests/`` and this file beside them as
``test/inductor/conftest.py``.  ``tools/conformance.py`` runs pytest with
that directory as its rootdir and confcutdir, so pytest loads it before the
test modules are imported.  ``conformance_backfill`` does the reverse job
(newer files on an older torch).

Everything here only fills in what the installed torch lacks:

* names newer torch renamed are aliased (HAS_CUDA -> HAS_CUDA_AND_TRITON, ...);
* names it removed become skip stubs: as a decorator a stub skips the test or
  class; called inside a test it raises unittest.SkipTest; as a flag it is
  False.  A stub never makes a test pass;
* modules it removed (torch.ao.quantization.quantizer, quantize_pt2e, pt2e,
  ...) get stand-in modules from a meta-path finder placed last on
  sys.meta_path, so a real module always wins; their attributes are stubs,
  except that PT2E quantization, which moved to torchao, leads to torchao's
  modules where torchao is installed (so the int8 tests run);
* the local ``skip_cache`` that test_cpu_select_algorithm.py and
  test_select_algorithm.py patch over AlgorithmSelectorCache.lookup gets the
  ``hint_override`` keyword newer torch passes (source rewritten on import).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
import types
import unittest

import torch

_REASON = "removed in torch {version}: {name} (2.6.0 test file on a newer torch)"


def _reason(name: str) -> str:
    return _REASON.format(version=torch.__version__, name=name)


class _Stub:
    """Stands in for a helper the installed torch removed.

    ``@stub`` on a function or class skips it; ``stub(...)`` otherwise raises
    unittest.SkipTest (so a test that calls it skips); ``stub[grid]`` (a
    Triton kernel launch) and ``stub.attr`` give the stub again; ``bool(stub)``
    is False, so ``if HAS_X:`` branches are not taken.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._reason = _reason(name)

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs:
            target = args[0]
            if isinstance(target, (type, types.FunctionType, types.MethodType)):
                return unittest.skip(self._reason)(target)
        raise unittest.SkipTest(self._reason)

    def __getitem__(self, key):
        return self

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self._name}.{attr}")

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<stub {self._name}>"


def _module(name: str):
    try:
        return importlib.import_module(name)
    except Exception:  # not in this build (e.g. a CUDA-only module)
        return None


def _alias(module_name: str, old: str, new: str) -> None:
    """``module.old = module.new`` (``new`` may be "other.module:attr")."""
    module = _module(module_name)
    if module is None or hasattr(module, old):
        return
    source_module, attr = module, new
    if ":" in new:
        source_name, attr = new.split(":")
        source_module = _module(source_name)
    if source_module is not None and hasattr(source_module, attr):
        setattr(module, old, getattr(source_module, attr))
    else:
        setattr(module, old, _Stub(f"{module_name}.{old}"))


def _provide(module_name: str, name: str, value) -> None:
    """``module.name = value`` where the module lacks the name."""
    module = _module(module_name)
    if module is not None and not hasattr(module, name):
        setattr(module, name, value)


def _stub_names(module_name: str, names) -> None:
    """Each of ``names`` the module lacks becomes a skip stub."""
    for name in names:
        _provide(module_name, name, _Stub(f"{module_name}.{name}"))


# -- renamed ------------------------------------------------------------------

_IU = "torch.testing._internal.inductor_utils"
_TU = "torch.testing._internal.triton_utils"
_alias(_IU, "HAS_CUDA", "HAS_CUDA_AND_TRITON")
_alias(_IU, "HAS_XPU", "HAS_XPU_AND_TRITON")
_alias(_TU, "HAS_CUDA", "HAS_CUDA_AND_TRITON")
_alias(_TU, "HAS_XPU", "HAS_XPU_AND_TRITON")
_alias(_TU, "requires_cuda", "requires_cuda_and_triton")
_alias(_TU, "requires_xpu", "requires_xpu_and_triton")
_alias(
    "torch.testing._internal.common_utils",
    "dtype_abbrs",
    "torch.utils._dtype_abbrs:dtype_abbrs",
)
# torch 2.9+: export() gives the training IR export_for_training gave.
_alias("torch.export", "export_for_training", "torch.export:export")

# -- removed ------------------------------------------------------------------

_stub_names(
    _TU,
    [  # Triton kernels, defined only where Triton is installed
        "add_kernel",
        "add_kernel_2d_autotuned",
        "add_kernel_autotuned",
        "add_kernel_autotuned_weird_param_order",
        "add_kernel_with_optional_param",
        "add_kernel_with_scaling",
        "add_kernel_with_tma_1d",
        "add_kernel_with_tma_2d",
        "mul2_inplace_kernel",
        "sub_kernel",
    ],
)

# PT2E quantization moved to torchao: where it is installed (never imported
# here, only where a test asks), the old module names lead to its modules and
# the helpers below use it; without it the int8 tests skip on stubs.
_TORCHAO_HOMES = {
    "torch.ao.quantization.quantizer": "torchao.quantization.pt2e.quantizer",
    "torch.ao.quantization.quantize_pt2e": "torchao.quantization.pt2e.quantize_pt2e",
    "torch.ao.quantization.pt2e": "torchao.quantization.pt2e",
}
_HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


def _move_exported_model_to_eval(model):
    from torchao.quantization.pt2e import move_exported_model_to_eval

    return move_exported_model_to_eval(model)


def _generate_qdq_quantized_model(
    mod, inputs, is_qat=False, is_dynamic=False, quantizer=None
):
    """`mod` exported, annotated by `quantizer` (torchao's X86 Inductor
    quantizer with its default settings unless given), run once on `inputs`
    to calibrate, and converted to quantize/dequantize pairs: what the 2.6.0
    helper of that name gave, as torchao spells it."""
    from torchao.quantization.pt2e import quantize_pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq

    if quantizer is None:
        quantizer = xiq.X86InductorQuantizer()
        quantizer.set_global(
            xiq.get_default_x86_inductor_quantization_config(
                is_qat=is_qat, is_dynamic=is_dynamic
            )
        )
    with contextlib.nullcontext() if is_qat else torch.no_grad():
        exported = torch.export.export(mod, tuple(inputs), strict=True).module()
        prepare = (
            quantize_pt2e.prepare_qat_pt2e if is_qat else quantize_pt2e.prepare_pt2e
        )
        prepared = prepare(exported, quantizer)
        prepared(*inputs)
        _move_exported_model_to_eval(prepared)
        return quantize_pt2e.convert_pt2e(prepared)


if _HAS_TORCHAO:
    _provide(
        "torch.testing._internal.common_quantization",
        "_generate_qdq_quantized_model",
        _generate_qdq_quantized_model,
    )
    _provide(
        "torch.ao.quantization",
        "move_exported_model_to_eval",
        _move_exported_model_to_eval,
    )
_stub_names(
    "torch.testing._internal.common_quantization", ["_generate_qdq_quantized_model"]
)
# 2.6.0's skipOps(test_case_name, base_test_name, to_skip) differs from the new one.
_stub_names("torch.testing._internal.common_methods_invocations", ["skipOps"])
_stub_names("torch.ao.quantization", ["move_exported_model_to_eval"])
_stub_names("torch._inductor.codecache", ["cuda_compile_command"])
_stub_names("torch._inductor.fx_passes.pad_mm", ["should_pad_common"])
_stub_names("torch._inductor.runtime.triton_heuristics", ["grid"])
# Only test_cpu_repro.py's test of the function itself calls it.
_stub_names("torch._inductor.compile_fx", ["complex_memory_overlap"])
_stub_names("torch._higher_order_ops.triton_kernel_wrap", ["identify_mutated_tensors"])


# -- removed modules: stand-ins -------------------------------------------------
# (Not conformance_plugin's stand-ins: those replace a borrowed test module
# that exists but fails to import; these answer for torch modules that are gone.)

# A module under one of these prefixes that no real finder finds.
_REMOVED_MODULE_PREFIXES = (
    "torch.ao.quantization.quantizer",
    "torch.ao.quantization.quantize_pt2e",
    "torch.ao.quantization.pt2e",
    "torch._inductor.codegen.cuda.cuda_kernel",
    "torch._inductor.codegen.cuda.cutlass_utils",
)


def _removed_module_getattr(module_name: str):
    def __getattr__(attr: str):
        # Refuse dunders: Dynamo and inspect read __file__, __path__, ...
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {attr!r}")
        return _Stub(f"{module_name}.{attr}")

    return __getattr__


def _torchao_home(name: str):
    """torchao's module for the removed module `name`, if torchao has one."""
    if not _HAS_TORCHAO:
        return None
    for old, new in _TORCHAO_HOMES.items():
        if name == old or name.startswith(old + "."):
            return _module(new + name[len(old) :])
    return None


class _RemovedModuleLoader(importlib.abc.Loader):
    """A stand-in, or where torchao has the module (`home`), a module whose
    attributes are torchao's: the classes and functions themselves, so a
    test's quantizer is the one torch's Inductor lowers."""

    def __init__(self, home=None) -> None:
        self._home = home

    def create_module(self, spec):
        return None  # the default module

    def exec_module(self, module) -> None:
        module.__path__ = []  # a package, so submodules come here too
        if self._home is not None:
            module.__doc__ = f"{module.__name__}, now {self._home.__name__}"
            module.__getattr__ = functools.partial(getattr, self._home)
        else:
            module.__doc__ = f"stand-in: {_reason(module.__name__)}"
            module.__getattr__ = _removed_module_getattr(module.__name__)


class _RemovedModuleFinder(importlib.abc.MetaPathFinder):
    """Last on sys.meta_path: answers only for modules nothing else found."""

    def find_spec(self, name, path=None, target=None):
        if not any(
            name == p or name.startswith(p + ".") for p in _REMOVED_MODULE_PREFIXES
        ):
            return None
        return importlib.machinery.ModuleSpec(
            name, _RemovedModuleLoader(_torchao_home(name)), is_package=True
        )


if not any(
    type(f).__name__ == "_RemovedModuleFinder" and f.__module__ == __name__
    for f in sys.meta_path
):
    sys.meta_path.append(_RemovedModuleFinder())


# -- skip_cache(): newer torch passes hint_override to lookup() ---------------

_SKIP_CACHE_FILES = ("test_cpu_select_algorithm", "test_select_algorithm")
_SKIP_CACHE_DEF = re.compile(r"def skip_cache\(self, choices, name, key, benchmark\):")
_SKIP_CACHE_NEW = (
    "def skip_cache(self, choices, name, key, benchmark, hint_override=None):"
)


class _SkipCacheLoader(importlib.machinery.SourceFileLoader):
    """Compiles the file with skip_cache() taking ``hint_override``."""

    def get_code(self, fullname):
        source = self.get_data(self.path).decode("utf-8")
        source = _SKIP_CACHE_DEF.sub(_SKIP_CACHE_NEW, source)
        return compile(source, self.path, "exec", dont_inherit=True)


class _SkipCacheFinder(importlib.abc.MetaPathFinder):
    """Swaps in _SkipCacheLoader under whatever loader found the file."""

    def find_spec(self, name, path=None, target=None):
        if name.rpartition(".")[2] not in _SKIP_CACHE_FILES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is None or spec.origin is None or spec.loader is None:
                continue
            ours = _SkipCacheLoader(name, spec.origin)
            # conformance_plugin wraps a borrowed module's loader in its own
            # (attribute .loader); keep that wrapper, replace what it wraps.
            if hasattr(spec.loader, "loader"):
                spec.loader.loader = ours
            else:
                spec.loader = ours
            return spec
        return None


def _lookup_takes_hint_override() -> bool:
    import inspect

    select_algorithm = _module("torch._inductor.select_algorithm")
    lookup = getattr(
        getattr(select_algorithm, "AlgorithmSelectorCache", None), "lookup", None
    )
    try:
        return (
            lookup is not None
            and "hint_override" in inspect.signature(lookup).parameters
        )
    except (TypeError, ValueError):
        return False


if _lookup_takes_hint_override() and not any(
    type(f).__name__ == "_SkipCacheFinder" for f in sys.meta_path
):
    sys.meta_path.insert(0, _SkipCacheFinder())
