"""torch_cppwrap's CppWrapperCodeCache: keys, memo, disk cache, errors, and
where it keeps what it builds."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from unittest import mock

import torch
from torch._inductor import config as inductor_config
from torch._inductor.codecache import get_lock_dir
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch._inductor.test_case import TestCase, run_tests
from torch._inductor.utils import fresh_cache

from tests.common import IDENTITY_SOURCE, checking_identity_source, seed_cache
from torch_cppwrap import _compat
from torch_cppwrap._inductor import codecache
from torch_cppwrap._inductor.codecache import (
    CppWrapperCodeCache,
    CppWrapperCompileError,
    GraphBuild,
)

# A launcher the wrapper declares and a translation unit of its own defines,
# as a CUDA graph's Triton launchers are.
LAUNCHER_DECLARATION = (
    '__attribute__((visibility("hidden"))) int64_t launched(int64_t v);'
)
LAUNCHER = f"{LAUNCHER_DECLARATION[:-1]} {{ return v + 1; }}"


def no_compiler(*args: object, **kwargs: object) -> None:
    raise AssertionError("the compiler ran")


class TestCodeCache(TestCase):
    """Each test has a fresh Inductor cache (upstream's TestCase), seeded with
    the suite's runtime extension and precompiled headers."""

    def setUp(self) -> None:
        super().setUp()
        seed_cache()

    def cppwrap_files(self, pattern: str) -> list[Path]:
        return list((Path(cache_dir()) / "cppwrap").rglob(pattern))

    def graph_modules(self) -> list[Path]:
        modules = self.cppwrap_files("*.so")
        return [p for p in modules if p.parent.parent.name != "runtime"]

    def test_build_load_memo_and_disk_hit(self) -> None:
        import torch

        source = IDENTITY_SOURCE % {"tag": "memo"}
        module = CppWrapperCodeCache.load(source)
        x = torch.randn(3)
        (out,) = module.call([x])
        self.assertIs(out, x)
        # In-process memo: the same module object.
        self.assertIs(CppWrapperCodeCache.load(source), module)
        # Disk hit: no compiler runs after the memo is cleared.
        CppWrapperCodeCache.cache_clear()
        with mock.patch.object(codecache.Build, "run", no_compiler):
            again = CppWrapperCodeCache.load(source)
        self.assertEqual(again.__file__, module.__file__)
        self.assertEqual(len(self.graph_modules()), 1)
        # No temporary build directories are left behind.
        self.assertFalse(self.cppwrap_files(".build-*"))

    def test_loading_a_module_again_leaves_the_others_alone(self) -> None:
        # Every graph module has one initialiser name.  Loading one a second
        # time in a process (after the memo is cleared, as Inductor's
        # fresh_cache() does) once handed back the module loaded last, its
        # functions swapped for the reloaded one's: a live graph then ran
        # another graph's code.
        a_source = IDENTITY_SOURCE % {"tag": "a"}
        a = CppWrapperCodeCache.load(a_source)
        b = CppWrapperCodeCache.load(
            checking_identity_source("b", 'throw std::runtime_error("b ran");')
        )
        CppWrapperCodeCache.cache_clear()
        again = CppWrapperCodeCache.load(a_source)
        self.assertIsNot(again, b)
        self.assertEqual(again.__file__, a.__file__)
        self.assertEqual(b.__doc__, "test module b")
        x = torch.randn(3)
        self.assertIs(again.call([x])[0], x)
        self.assertIs(a.call([x])[0], x)
        with self.assertRaisesRegex(RuntimeError, "b ran"):
            b.call([x])

    def test_runtime_sources_changed_under_a_running_process(self) -> None:
        # An upgrade while a process runs: new graphs would be built against
        # runtime headers that the loaded runtime extension does not match.
        CppWrapperCodeCache.load(IDENTITY_SOURCE % {"tag": "before"})
        with (
            mock.patch.object(codecache, "_runtime_sources_digest", lambda: "new"),
            mock.patch.object(codecache.Build, "run", no_compiler),
            self.assertRaisesRegex(RuntimeError, "changed after this process loaded"),
        ):
            CppWrapperCodeCache.load(IDENTITY_SOURCE % {"tag": "after"})

    def test_runtime_drops_one_streams_cublas_workspaces_where_torch_can(
        self,
    ) -> None:
        # libtorch_cuda has a per-stream drop from torch 2.12 on; the runtime
        # reaches it through a weak reference, so that it loads without it
        # (a CPU build, torch 2.11) and does nothing there.
        runtime = codecache.RuntimeExtension.load()
        since_2_12 = _compat.torch_version_tuple() >= (2, 12)
        can = torch.version.cuda is not None and since_2_12
        self.assertIs(runtime.DROPS_CUBLAS_WORKSPACES, can)
        # No workspace is kept for this stream handle: nothing to drop, and
        # nothing run on a device.
        self.assertIsNone(runtime.drop_cublas_workspaces(0x10))

    def test_key_depends_on_source(self) -> None:
        a = CppWrapperCodeCache.load(IDENTITY_SOURCE % {"tag": "a"})
        b = CppWrapperCodeCache.load(IDENTITY_SOURCE % {"tag": "b"})
        self.assertNotEqual(a.__file__, b.__file__)
        self.assertEqual(a.__doc__, "test module a")

    def test_compile_error_carries_command_output_and_source(self) -> None:
        broken = IDENTITY_SOURCE % {"tag": "broken"} + "\nthis is not C++;\n"
        with self.assertRaises(CppWrapperCompileError) as ctx:
            CppWrapperCodeCache.load(broken)
        err = ctx.exception
        self.assertTrue(err.source_path.endswith("wrapper.cpp"))
        self.assertTrue(os.path.exists(err.source_path))
        self.assertIn("this is not C++", Path(err.source_path).read_text())
        self.assertIn("error", err.output)
        self.assertTrue(any(arg.endswith("wrapper.cpp") for arg in err.cmd))
        self.assertIn("Command:", str(err))
        # A failed build leaves no module behind.
        self.assertFalse(self.graph_modules())

    def test_wrapper_built_early_is_linked_with_the_launchers(self) -> None:
        # A CUDA graph's wrapper compiles while its kernels are tuned; its
        # launchers, defined once they are, compile at the load, which links
        # the early object instead of compiling the wrapper again.
        import torch

        wrapper = IDENTITY_SOURCE.replace(
            '#include "cppwrap_runtime.h"\n',
            '#include "cppwrap_runtime.h"\n' + LAUNCHER_DECLARATION,
        ).replace(
            "    cppwrap::clear_args(args);\n",
            "    cppwrap::clear_args(args);\n    if (launched(41) != 42) return nullptr;\n",
        ) % {"tag": "early"}
        runs: list[str] = []
        real_run = codecache.Build.run

        def counting(build: codecache.Build, *args: object) -> Path:
            runs.append(build.name)
            return real_run(build, *args)

        with mock.patch.object(codecache.Build, "run", counting):
            codecache.start_wrapper_build(wrapper, "cpu")
            module = CppWrapperCodeCache.load(wrapper, launchers=[LAUNCHER])
        x = torch.randn(2)
        (out,) = module.call([x])
        self.assertIs(out, x)
        self.assertEqual(sorted(runs), ["launchers", "module", "wrapper"])
        self.assertIsNone(codecache.take_wrapper_build(wrapper, "cpu"))
        # The graph's directory holds both sources, for reading.
        directory = Path(module.__cppwrap_source_dir__)
        self.assertIn("launched(41)", (directory / "wrapper.cpp").read_text())
        self.assertIn("v + 1", (directory / "launchers.cpp").read_text())

    def test_launchers_compile_in_units_side_by_side(self) -> None:
        # A graph's launchers are all that compiles after its kernels are
        # tuned: they split into units of LAUNCHERS_PER_UNIT or more, one
        # per compile thread at most, each starting with the device's header.
        import torch

        per_unit = codecache.LAUNCHERS_PER_UNIT
        others = [
            f'__attribute__((visibility("hidden"))) int other_{i}() {{ return {i}; }}'
            for i in range(3 * per_unit - 1)
        ]
        with inductor_config.patch(compile_threads=4):
            for count, units in ((1, 1), (per_unit, 1), (2 * per_unit, 2)):
                self.assertEqual(
                    len(codecache.launcher_units(others[:count], "cpu")), units
                )
            wrapper = IDENTITY_SOURCE.replace(
                '#include "cppwrap_runtime.h"\n',
                '#include "cppwrap_runtime.h"\n' + LAUNCHER_DECLARATION,
            ).replace(
                "    cppwrap::clear_args(args);\n",
                "    cppwrap::clear_args(args);\n    if (launched(1) != 2) return nullptr;\n",
            ) % {"tag": "units"}
            runs: list[str] = []
            real_run = codecache.Build.run

            def counting(build: codecache.Build, *args: object) -> Path:
                runs.append(build.name)
                return real_run(build, *args)

            with mock.patch.object(codecache.Build, "run", counting):
                module = CppWrapperCodeCache.load(
                    wrapper, launchers=[*others, LAUNCHER]
                )
        x = torch.randn(2)
        (out,) = module.call([x])
        self.assertIs(out, x)
        self.assertEqual(
            sorted(runs),
            ["launchers_0", "launchers_1", "launchers_2", "module", "wrapper"],
        )
        directory = Path(module.__cppwrap_source_dir__)
        texts = [(directory / f"launchers_{i}.cpp").read_text() for i in range(3)]
        for text in texts:
            self.assertTrue(text.startswith('#include "cppwrap_runtime.h"\n'), text)
        self.assertEqual(sum(t.count("int other_") for t in texts), len(others))
        self.assertIn("v + 1", texts[-1])

    def test_error_of_an_early_wrapper_build_is_raised_by_the_load(self) -> None:
        broken = IDENTITY_SOURCE % {"tag": "broken early"} + "\nthis is not C++;\n"
        codecache.start_wrapper_build(broken, "cpu")
        with self.assertRaises(CppWrapperCompileError) as ctx:
            CppWrapperCodeCache.load(broken, launchers=[LAUNCHER])
        self.assertIn("this is not C++", Path(ctx.exception.source_path).read_text())
        self.assertFalse(self.graph_modules())
        self.assertIsNone(codecache.take_wrapper_build(broken, "cpu"))

    def test_each_devices_wrapper_header_is_precompiled_and_used(self) -> None:
        # A wrapper unit starts with its device's header, whose precompiled
        # form gcc then reads instead of parsing the headers ("!" in -H's
        # list); on CUDA that header takes in the CUDA C shim's declarations.
        tc = codecache.toolchain()
        for device_type, header in codecache.WRAPPER_HEADERS.items():
            with self.subTest(device_type), tempfile.TemporaryDirectory() as tmp:
                pch = codecache.wrapper_runtime_pch(tc, device_type)
                assert pch is not None
                Path(tmp, "unit.cpp").write_text(f'#include "{header}"\n')
                build = tc.wrapper_compile(device_type, "unit.cpp").with_include_dir(
                    pch
                )
                listed = subprocess.run(
                    [*shlex.split(build.command()), "-H"],
                    cwd=tmp,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stderr
                self.assertIn(f"! {pch / header}.gch", listed)

    def test_concurrent_loads_build_once(self) -> None:
        source = IDENTITY_SOURCE % {"tag": "threads"}
        calls = []
        real = GraphBuild.build

        def counting(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)

        results = []
        with mock.patch.object(GraphBuild, "build", counting):
            threads = [
                threading.Thread(
                    target=lambda: results.append(CppWrapperCodeCache.load(source))
                )
                for _ in range(3)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        self.assertEqual(len(results), 3)
        self.assertEqual(len(calls), 1)

    @inductor_config.patch(file_lock_timeout=0.2)
    def test_lock_timeout_is_a_clear_error(self) -> None:
        from filelock import FileLock

        target = Path(cache_dir()) / "cppwrap" / "test" / "artefact.so"
        lock = FileLock(os.path.join(get_lock_dir(), "cppwrap-test-key.lock"))
        with lock, self.assertRaises(RuntimeError) as ctx:
            codecache.ensure_built(target, "test-key", "a test artefact", no_compiler)
        self.assertIn("timed out", str(ctx.exception))
        self.assertIn("a test artefact", str(ctx.exception))
        self.assertIn("file_lock_timeout", str(ctx.exception))

    def test_everything_lives_under_inductors_cache_dir(self) -> None:
        root = Path(cache_dir()) / "cppwrap"
        module = CppWrapperCodeCache.load(IDENTITY_SOURCE % {"tag": "where"})
        self.assertTrue(Path(module.__file__).is_relative_to(root))
        self.assertTrue(codecache.RuntimeExtension.artefact()[1].is_relative_to(root))
        with tempfile.TemporaryDirectory() as tmp:
            header = Path(tmp, "tiny.h")
            header.write_text("inline int tiny() { return 1; }\n")
            pch_dir = codecache.precompiled_header_dir(
                header, "tiny.h", self.tiny_header_build(), "digest"
            )
        if pch_dir is not None:  # gcc only
            self.assertTrue(pch_dir.is_relative_to(root))
            self.assertTrue((pch_dir / "tiny.h.gch").is_file())

    @staticmethod
    def tiny_header_build() -> codecache.Build:
        return codecache.Build("header", ("tiny.h",), (("precompiling", True),))

    def test_fresh_cache_starts_the_code_cache_afresh(self) -> None:
        source = IDENTITY_SOURCE % {"tag": "fresh"}
        paths = []
        for _ in range(2):
            with fresh_cache():
                seed_cache()
                paths.append(CppWrapperCodeCache.load(source).__file__)
                self.assertTrue(paths[-1].startswith(cache_dir()))
        self.assertNotEqual(paths[0], paths[1])

    def test_build_stamp_follows_config_filled_in_place(self) -> None:
        # AOTInductor fills aot_inductor.metadata in place, which leaves
        # Inductor's config hash as it was; the stamp of the build
        # environment must follow the entry all the same (a stamp kept by
        # that hash once filed a later compile's build records elsewhere).
        with inductor_config.patch({"aot_inductor.metadata": {}}):
            empty = codecache._environment_stamp()
            inductor_config.aot_inductor.metadata["AOTI_PLATFORM"] = "linux"
            filled = codecache._environment_stamp()
        self.assertNotEqual(filled, empty)
        self.assertEqual(codecache._environment_stamp(), codecache._environment_stamp())

    def test_a_built_module_loads_without_working_out_build_options(self) -> None:
        # What keys hash (the compile commands, the compiler's version) is
        # kept in the cache per build environment, so a process that only
        # loads built modules (an FX graph cache hit) neither runs the
        # compiler nor makes cpp_builder's options, whose first use imports
        # torch.utils.cpp_extension and setuptools.
        source = IDENTITY_SOURCE % {"tag": "options"}
        # Built under the config a cpp_wrapper compile patches in, loaded
        # without it, as a later process that hits the FX graph cache does.
        with inductor_config.patch(
            {"triton.store_cubin": True, "triton.autotune_at_compile_time": True}
        ):
            built = CppWrapperCodeCache.load(source)
            # What a process's first compile records of the runtime extension,
            # which this process may have loaded in an earlier test.
            codecache.RuntimeExtension.artefact()
        CppWrapperCodeCache.cache_clear()
        codecache._BuildMemo._entries.clear()  # as in a new process

        def no_options(*args: object, **kwargs: object) -> None:
            raise AssertionError("build options were worked out")

        with (
            mock.patch.object(codecache._compat, "build_options", no_options),
            mock.patch.object(codecache.cpp_builder, "get_cpp_compiler", no_options),
            mock.patch.object(codecache.Build, "run", no_compiler),
        ):
            again = CppWrapperCodeCache.load(source)
            codecache.RuntimeExtension.artefact()
        self.assertEqual(again.__file__, built.__file__)
        # Another environment (a compiler flag in CXXFLAGS) has no record:
        # its options are worked out, and give the same key here.
        CppWrapperCodeCache.cache_clear()
        real = codecache._compat.build_options
        made: list[object] = []

        def spy(*args: object, **kwargs: object) -> object:
            made.append(kwargs)
            return real(*args, **kwargs)

        with (
            mock.patch.dict(os.environ, {"CXXFLAGS": "-DCPPWRAP_TEST"}),
            mock.patch.object(codecache._compat, "build_options", spy),
            mock.patch.object(codecache.Build, "run", no_compiler),
        ):
            self.assertEqual(CppWrapperCodeCache.load(source).__file__, built.__file__)
        self.assertTrue(made)

    def test_a_graph_module_links_libtorch_alone(self) -> None:
        # The C shim a module calls is found, when it is loaded, in
        # libtorch.so's own dependencies (libtorch_cpu, libtorch_cuda), so
        # its link never reads their symbol tables.
        link = codecache.toolchain().link(["wrapper.o"]).command()
        libraries = re.findall(r"(?<!\S)-l(\S+)", link)
        self.assertIn("torch", libraries, link)
        self.assertFalse(
            {"torch_cpu", "torch_cuda", "torch_python"} & set(libraries), link
        )
        self.assertLess(link.index("-Wl,--no-as-needed"), link.index("-ltorch "))

        import torch

        @torch.compile
        def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.mm(x, y).relu() + 1  # mm: a C-shim call

        x, y = torch.randn(8, 8), torch.randn(8, 8)
        with inductor_config.patch(cpp_wrapper=True, fx_graph_cache=False):
            self.assertEqual(fn(x, y), torch.mm(x, y).relu() + 1)
        (module,) = self.graph_modules()
        readelf = shutil.which("readelf")
        if readelf is not None:
            needed = re.findall(
                r"\(NEEDED\).*\[(.*)\]",
                subprocess.run(
                    [readelf, "-d", str(module)], capture_output=True, text=True
                ).stdout,
            )
            self.assertIn("libtorch.so", needed)
            self.assertFalse([n for n in needed if n.startswith("libtorch_")], needed)

    def test_a_moved_cache_keeps_its_modules(self) -> None:
        # Keys hash content, not where the cache is: a copy of the cache
        # under another path (with a space in it) serves the same modules.
        source = IDENTITY_SOURCE % {"tag": "moved"}
        kernel = "#include <torch/csrc/inductor/cpp_prefix.h>\nvoid moved_kernel() {}\n"
        built = CppWrapperCodeCache.load(source, kernel)
        with tempfile.TemporaryDirectory() as tmp:
            moved = Path(tmp, "moved cache")
            shutil.copytree(cache_dir(), moved)
            CppWrapperCodeCache.cache_clear()
            with (
                mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": str(moved)}),
                mock.patch.object(codecache.Build, "run", no_compiler),
            ):
                again = CppWrapperCodeCache.load(source, kernel)
            self.assertTrue(again.__file__.startswith(str(moved)))
        self.assertEqual(Path(again.__file__).name, Path(built.__file__).name)


if __name__ == "__main__":
    run_tests()
