"""patch()/unpatch(): every replaced name, before and after."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import textwrap
from unittest import mock

import torch
import torch._inductor.codecache as inductor_codecache
from torch._inductor import compile_fx, ir
from torch._inductor import config as inductor_config
from torch._inductor.codegen import common, cpp
from torch._inductor.compile_fx_subproc import _SubprocessFxCompile
from torch._inductor.test_case import TestCase, run_tests
from torch._inductor.virtualized import V

import torch_cppwrap
from torch_cppwrap import _compat, _patching
from torch_cppwrap._inductor import graph as graph_module
from torch_cppwrap._inductor.codecache import CppWrapperCodeCache
from torch_cppwrap._inductor.codegen.cpp_parallel_errors import CatchingWorkSharing

# Names in Inductor's C++ kernel codegen that patch() replaces.
KERNEL_CODEGEN_NAMES = [
    (cpp, "WorkSharing"),
    (cpp.CppKernel, "check_bounds"),
    (cpp.CppKernel, "device_assert_async"),
    (cpp.CppKernelProxy, "gen_body"),
]
# The settings of a cpp_wrapper compile.
CONFIG_NAMES = [(compile_fx, "get_cpp_wrapper_config")]


class TestPatching(TestCase):
    def setUp(self) -> None:
        super().setUp()
        torch_cppwrap.patch()

    def tearDown(self) -> None:
        torch_cppwrap.patch()  # leave the process patched for other tests
        super().tearDown()

    def assert_patched(self) -> None:
        self.assertTrue(torch_cppwrap.is_patched())
        self.assertIs(
            common.get_wrapper_codegen_for_device("cpu", cpp_wrapper=True),
            _patching.CpuCppWrapperSelector,
        )
        self.assertIs(inductor_codecache.CppWrapperCodeCache, CppWrapperCodeCache)
        self.assertIs(
            ir.ExternKernel.try_get_kernel_name, _patching._try_get_kernel_name
        )
        self.assertIs(cpp.WorkSharing, CatchingWorkSharing)
        tag = common.custom_backend_passes["cpu"]
        self.assertEqual(tag.uuid()[0], "torch_cppwrap")
        self.assertIs(
            _SubprocessFxCompile._run_in_child_subprocess,
            _patching.compile_in_subprocess,
        )

    def test_patch_replaces_every_name(self) -> None:
        self.assert_patched()
        # Every loaded Inductor module that names a CppWrapperCodeCache names
        # ours (the import of torch._inductor.codecache's name by another
        # module is what a patch of the defining module alone would miss).
        holders = [
            name
            for name, module in list(sys.modules.items())
            if name.startswith("torch._inductor")
            and hasattr(module, "CppWrapperCodeCache")
        ]
        self.assertIn("torch._inductor.codecache", holders)
        for name in holders:
            self.assertIs(sys.modules[name].CppWrapperCodeCache, CppWrapperCodeCache)
        from torch._inductor.graph import GraphLowering

        for owner, name in [
            (GraphLowering, "_compile_to_module"),
            (ir.InplaceBernoulliFallback, "codegen"),
            *KERNEL_CODEGEN_NAMES,
            *CONFIG_NAMES,
        ]:
            self.assertIsNot(
                getattr(owner, name), torch_cppwrap.get_original(owner, name)
            )

    def test_inductor_vec_isa_probe_is_left_alone(self) -> None:
        # The probe serves every Inductor mode, the Python wrapper's included:
        # patching it would change them all, and tilt compile-time comparisons.
        from torch._inductor.cpu_vec_isa import VecISA

        self.assertFalse(hasattr(VecISA.check_build, "__wrapped__"))
        self.assertNotIn(VecISA, [owner for owner, _ in _patching._originals])

    def test_patch_is_idempotent_and_keeps_true_originals(self) -> None:
        original_cache = torch_cppwrap.get_original(
            inductor_codecache, "CppWrapperCodeCache"
        )
        original_name = torch_cppwrap.get_original(
            ir.ExternKernel, "try_get_kernel_name"
        )
        torch_cppwrap.patch()
        torch_cppwrap.patch()
        self.assert_patched()
        self.assertIs(
            torch_cppwrap.get_original(inductor_codecache, "CppWrapperCodeCache"),
            original_cache,
        )
        self.assertIs(
            torch_cppwrap.get_original(ir.ExternKernel, "try_get_kernel_name"),
            original_name,
        )
        self.assertIsNot(original_cache, CppWrapperCodeCache)
        self.assertEqual(original_cache.__module__, "torch._inductor.codecache")

    def test_unpatch_restores_every_original(self) -> None:
        original_cache = torch_cppwrap.get_original(
            inductor_codecache, "CppWrapperCodeCache"
        )
        holders = _patching.modules_holding_code_cache(CppWrapperCodeCache)
        original_entry = _patching._registry_originals["cpu"][0]
        original_name = torch_cppwrap.get_original(
            ir.ExternKernel, "try_get_kernel_name"
        )
        from torch._inductor.graph import GraphLowering

        originals = {
            (owner, name): torch_cppwrap.get_original(owner, name)
            for owner, name in [
                (GraphLowering, "_compile_to_module"),
                (ir.InplaceBernoulliFallback, "codegen"),
                *KERNEL_CODEGEN_NAMES,
                *CONFIG_NAMES,
            ]
        }

        subprocess_entry = torch_cppwrap.get_original(
            _SubprocessFxCompile, "_run_in_child_subprocess"
        )

        torch_cppwrap.unpatch()
        for (owner, name), original in originals.items():
            self.assertIs(getattr(owner, name), original)
        self.assertFalse(torch_cppwrap.is_patched())
        self.assertIs(inductor_codecache.CppWrapperCodeCache, original_cache)
        for module in holders:
            self.assertIs(module.CppWrapperCodeCache, original_cache)
        self.assertIs(common.device_codegens["cpu"], original_entry)
        self.assertIsNot(
            common.get_wrapper_codegen_for_device("cpu", cpp_wrapper=True),
            _patching.CpuCppWrapperSelector,
        )
        self.assertIs(ir.ExternKernel.try_get_kernel_name, original_name)
        self.assertIsNone(common.custom_backend_passes.get("cpu"))
        self.assertIs(
            _SubprocessFxCompile.__dict__["_run_in_child_subprocess"],
            subprocess_entry,
        )

        torch_cppwrap.patch()
        self.assert_patched()

    def test_unpatched_compile_uses_upstream(self) -> None:
        from torch._inductor import config
        from torch._inductor.utils import run_and_get_code

        torch_cppwrap.unpatch()
        try:
            torch._dynamo.reset()
            x = torch.randn(8)
            with config.patch(cpp_wrapper=True, fx_graph_cache=False):
                result, (source,) = run_and_get_code(
                    torch.compile(lambda x: x.sin() + 1), x
                )
        finally:
            torch_cppwrap.patch()
        self.assertEqual(result, x.sin() + 1)
        self.assertNotIn("torch_cppwrap", source)
        self.assertIn(
            "from torch._inductor.codecache import CppWrapperCodeCache", source
        )

    def test_a_compile_subprocess_generates_our_wrapper(self) -> None:
        # TORCHINDUCTOR_FX_COMPILE_MODE=subprocess: a subprocess generates and
        # builds the graph's code, which this process then loads.  Unpatched
        # there, it generated upstream's C++ wrapper, whose module our code
        # cache refuses to build, and the compile failed.
        from torch._inductor.utils import run_and_get_code

        from tests.common import seed_cache

        seed_cache()
        torch._dynamo.reset()

        def fn(x: torch.Tensor) -> torch.Tensor:
            return torch.topk(x.sin(), 2).values * 2

        x = torch.randn(4, 8)
        subprocess_mode = compile_fx.FxCompileMode.SUBPROCESS
        with (
            mock.patch.object(compile_fx, "fx_compile_mode", subprocess_mode),
            inductor_config.patch(cpp_wrapper=True, fx_graph_cache=False),
        ):
            result, (source,) = run_and_get_code(torch.compile(fn), x)
        self.assertIn("from torch_cppwrap._inductor.codecache import", source)
        self.assertEqual(result, fn(x))

    def test_aot_mode_keeps_upstream_wrapper(self) -> None:
        # AOTInductor packages upstream's C-shim wrapper into a model .so: a
        # real AOT compile, while patched, is generated by the class that our
        # selector displaced, never by ours.  package_cpp_only stops after the
        # C++ is written, sparing the minute that building the .so takes.
        import zipfile
        from unittest import mock

        from torch_cppwrap._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

        upstream = _patching._registry_originals["cpu"][0].cpp_wrapper_codegen
        self.assertIs(_patching.CpuCppWrapperSelector.displaced, upstream)
        self.assertEqual(upstream.__module__, "torch._inductor.codegen.cpp_wrapper_cpu")

        class Model(torch.nn.Module):
            def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                return (x @ y).relu() + 1

        args = (torch.randn(8, 8), torch.randn(8, 8))
        with (
            tempfile.TemporaryDirectory() as tmp,
            mock.patch.object(upstream, "create", wraps=upstream.create) as theirs,
            mock.patch.object(
                CppWrapperCpu, "create", wraps=CppWrapperCpu.create
            ) as ours,
        ):
            package = torch._inductor.aoti_compile_and_package(
                torch.export.export(Model(), args),
                package_path=os.path.join(tmp, "model.pt2"),
                inductor_configs={"aot_inductor.package_cpp_only": True},
            )
            with zipfile.ZipFile(package) as archive:
                (wrapper,) = [
                    n for n in archive.namelist() if n.endswith("wrapper.cpp")
                ]
                source = archive.read(wrapper).decode()
        self.assertGreaterEqual(theirs.call_count, 1)
        self.assertEqual(ours.call_count, 0)
        # The AOTI runtime's model class, not our extension module.
        self.assertIn("AOTInductorModel", source)
        self.assertNotIn("cppwrap", source)

    def test_unsupported_torch_warns_and_patches_nothing(self) -> None:
        self.assertFalse(_compat.torch_is_supported("2.10.0"))
        self.assertFalse(_compat.torch_is_supported("2.16.0"))
        self.assertTrue(_compat.torch_is_supported("2.15.0"))
        self.assertTrue(_compat.torch_is_supported("2.11.0+cu130"))
        script = textwrap.dedent(
            """
            import warnings, torch
            torch.__version__ = "2.10.0"  # pretend an unsupported release
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                import torch_cppwrap
            from torch._inductor import codecache
            print(torch_cppwrap.is_patched())
            print(codecache.CppWrapperCodeCache.__module__)
            print([str(w.message) for w in caught if "supports torch" in str(w.message)])
            """
        )
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True
        ).stdout.splitlines()
        self.assertEqual(out[0], "False")
        self.assertEqual(out[1], "torch._inductor.codecache")
        self.assertIn("nothing was patched", out[2])


class TestCppWrapperSettings(TestCase):
    """The settings a cpp_wrapper compile runs under, with Triton or without
    it: torch 2.12 on leaves Triton's tuning to a kernel's first launch unless
    told otherwise, which our CUDA wrapper does not do."""

    def setUp(self) -> None:
        super().setUp()
        torch_cppwrap.patch()

    def settings(
        self, setting: bool | None, *, triton: bool, aot: bool = False
    ) -> tuple[dict[str, object], dict[str, object]]:
        """(ours, upstream's) for `setting` of triton.autotune_at_compile_time."""
        original = torch_cppwrap.get_original(compile_fx, "get_cpp_wrapper_config")
        with (
            inductor_config.patch({"triton.autotune_at_compile_time": setting}),
            mock.patch("torch.utils._triton.has_triton", return_value=triton),
            # upstream's own import of it
            mock.patch.object(compile_fx, "has_triton", return_value=triton),
            V.set_aot_compilation(aot),
        ):
            return compile_fx.get_cpp_wrapper_config(), original()

    def test_unset_means_tuning_while_compiling_where_triton_is(self) -> None:
        ours, upstream = self.settings(None, triton=True)
        self.assertIs(ours["triton.autotune_at_compile_time"], True)
        self.assertIs(ours["triton.autotune_cublasLt"], False)
        # Nothing else changes.
        self.assertEqual(
            {k: v for k, v in ours.items() if "autotune" not in k},
            {k: v for k, v in upstream.items() if "autotune" not in k},
        )

    def test_false_means_tuning_while_compiling_too(self) -> None:
        # Upstream's wrapper tunes on the first call's inputs then; ours tunes
        # while compiling, which for a JIT graph is within its first call.
        graph_module._log_tuning_while_compiling.cache_clear()
        with self.assertLogs(graph_module.log, logging.INFO) as logged:
            ours, upstream = self.settings(False, triton=True)
            # Said once a process, not for every graph a compile lowers.
            self.settings(False, triton=True)
        self.assertEqual(len(logged.records), 1, logged.output)
        self.assertIn("tunes Triton kernels while the graph compiles", logged.output[0])
        self.assertIs(upstream["triton.autotune_at_compile_time"], False)
        self.assertIs(ours["triton.autotune_at_compile_time"], True)
        self.assertIs(ours["triton.autotune_cublasLt"], False)
        ours, upstream = self.settings(True, triton=True)
        self.assertEqual(ours, upstream)

    def test_without_triton_or_for_aot_inductor_upstream_decides(self) -> None:
        for setting in (None, False, True):
            for triton, aot in ((False, False), (True, True)):
                with self.subTest(setting=setting, triton=triton, aot=aot):
                    ours, upstream = self.settings(setting, triton=triton, aot=aot)
                    self.assertEqual(ours, upstream)

    def test_unpatched_is_upstream(self) -> None:
        original = torch_cppwrap.get_original(compile_fx, "get_cpp_wrapper_config")
        self.assertIsNot(compile_fx.get_cpp_wrapper_config, original)
        torch_cppwrap.unpatch()
        try:
            self.assertIs(compile_fx.get_cpp_wrapper_config, original)
        finally:
            torch_cppwrap.patch()


if __name__ == "__main__":
    run_tests()
