"""The upstream patch series (patches/torch-<X.Y>/): it is current, it applies,
and the torch it produces compiles with our C++ wrapper on its own, without
torch_cppwrap imported."""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any
from unittest import mock

from torch._inductor.test_case import TestCase, run_tests
from torch.testing._internal.common_utils import slowTest

from tests.common import load_script

_patches = load_script("tools/patches.py")
SITE_PACKAGES = _patches.installed_site_packages()
TORCH_VERSION = _patches.torch_version_of(SITE_PACKAGES)
SERIES = _patches.DEFAULT_PATCHES_DIR / _patches.series_dir_name(TORCH_VERSION)

# Runs under the patched torch.  Prints one JSON line: what the tests assert.
PATCHED_TORCH_SCRIPT = textwrap.dedent(
    """
    import json
    import sys
    from unittest import mock

    import torch
    from torch._inductor import config
    from torch._inductor.codegen import common
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    from torch._inductor.codegen.cpp_wrapper_cpu_jit import CppWrapperCpuJit
    from torch._inductor.utils import run_and_get_code

    common.init_backend_registration()
    report = {
        "torch_file": torch.__file__,
        "wrapper_file": sys.modules[CppWrapperCpuJit.__module__].__file__,
        "jit_is_ours": common.get_wrapper_codegen_for_device("cpu", True)
        is CppWrapperCpuJit,
        "aot_keeps_upstream": common.get_wrapper_codegen_for_device(
            "cpu", True, aot_mode=True
        )
        is CppWrapperCpu,
        "cases": {},
    }

    torch.manual_seed(0)
    cases = {
        "seed": (lambda x, y: (x + y).sum(), torch.randn(128, 128), torch.randn(128, 128)),
        "mm": (lambda a, b: a @ b, torch.randn(64, 32), torch.randn(32, 16)),
        "pointwise": (lambda x: torch.relu(x) * 2 + x.sin(), torch.randn(8, 33)),
    }
    for name, (fn, *args) in cases.items():
        torch._dynamo.reset()
        with config.patch(cpp_wrapper=True), mock.patch.object(
            CppWrapperCpuJit, "create", wraps=CppWrapperCpuJit.create
        ) as create:
            actual, codes = run_and_get_code(torch.compile(fn), *args)
        torch.testing.assert_close(actual, fn(*args), rtol=1e-4, atol=1e-4)
        report["cases"][name] = {"wrappers_made": create.call_count, "code": codes[0]}

    # A node whose codegen the series routes to our wrapper (ir.py).
    def bernoulli(a):
        return torch.ops.aten.bernoulli_(a.clone(), 0.3)

    x = torch.ones(64, 64)
    torch.manual_seed(7)
    expected = bernoulli(x)
    torch._dynamo.reset()
    with config.patch(cpp_wrapper=True, fallback_random=True), mock.patch.object(
        CppWrapperCpuJit, "create", wraps=CppWrapperCpuJit.create
    ) as create:
        torch.manual_seed(7)
        actual, codes = run_and_get_code(torch.compile(bernoulli), x)
    torch.testing.assert_close(actual, expected)
    report["cases"]["bernoulli"] = {"wrappers_made": create.call_count, "code": codes[0]}

    report["torch_cppwrap_imported"] = any(
        m == "torch_cppwrap" or m.startswith("torch_cppwrap.") for m in sys.modules
    )
    print(json.dumps(report))
    """
)


# AOTInductor under the patched torch: it must keep upstream's C-shim wrapper.
AOT_SCRIPT = textwrap.dedent(
    """
    import json
    import os
    import sys
    from unittest import mock

    import torch
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    from torch._inductor.codegen.cpp_wrapper_cpu_jit import CppWrapperCpuJit


    class Model(torch.nn.Module):
        def forward(self, x, y):
            return (x @ y).relu() + 1


    model, args = Model(), (torch.randn(8, 8), torch.randn(8, 8))
    with mock.patch.object(
        CppWrapperCpuJit, "create", wraps=CppWrapperCpuJit.create
    ) as ours, mock.patch.object(
        CppWrapperCpu, "create", wraps=CppWrapperCpu.create
    ) as upstream:
        path = torch._inductor.aoti_compile_and_package(
            torch.export.export(model, args),
            package_path=os.path.join(os.getcwd(), "model.pt2"),  # a temporary dir
        )
    runner = torch._inductor.aoti_load_package(path)
    torch.testing.assert_close(runner(*args), model(*args))
    print(json.dumps({
        "ours_made": ours.call_count,
        "upstream_made": upstream.call_count,
        "torch_cppwrap_imported": "torch_cppwrap" in sys.modules,
    }))
    """
)


# The suite's own directory under the system's temporary directory (as in
# conftest.py): the patched torch and its Inductor cache live there.
SUITE_DIR = Path(tempfile.gettempdir()) / f"torch_cppwrap-tests-{os.getuid()}"


def patched_torch() -> Path:
    """A directory whose torch/ is the installed torch with the committed series
    applied: symlinks to the installed files, real copies of the patched
    ones (well under a second to build).

    Its path is fixed per torch version, and the tree is rebuilt only when the
    series changes: the runtime extension and the precompiled headers are
    cached under keys that include their compile commands, which name
    torch's include directory in this tree, so a new temporary directory per
    run would rebuild them (about two minutes on two cores).
    """
    from filelock import FileLock

    digest = hashlib.sha256(str(SITE_PACKAGES).encode())
    for name in ["series", *_patches.read_series(SERIES)]:
        digest.update((SERIES / name).read_bytes())
    parent = SUITE_DIR / "patched-torch"
    root, stamp = parent / TORCH_VERSION, parent / f"{TORCH_VERSION}.series"
    parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(parent / f"{TORCH_VERSION}.lock"), timeout=600):
        if (
            root.is_dir()
            and stamp.is_file()
            and stamp.read_text() == digest.hexdigest()
        ):
            return root
        stamp.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)
        _patches.make_patched_torch(SERIES, SITE_PACKAGES, root)
        stamp.write_text(digest.hexdigest())
    return root


# A class in sections, as cpp_wrapper_cpu.py is; the series adds the second
# section in a patch of its own.
SECTIONED = textwrap.dedent(
    """
    from typing import Any


    class Wrapper(Base):
        # ------------------------------------------------------------------
        # core
        # ------------------------------------------------------------------

        def run(self) -> str:
            return self._spell()

        def _spell(self) -> str:
            return "core"

        # ------------------------------------------------------------------
        # extra ops: what a later patch adds
        # ------------------------------------------------------------------

        def codegen_extra(self) -> str:
            return self._extra_helper()

        def _extra_helper(self) -> str:
            return "extra"

        def _base_hook(self) -> str:
            return "ours"


    def after() -> str:
        return "after the class"
    """
)
EXTRA = "extra ops: what a later patch adds"


class TestSections(TestCase):
    def staged(self, text: str) -> dict[str, Any]:
        source = _patches.hold_back(text, [EXTRA], frozenset({"_base_hook"}), "x.py")
        self.assertIn("# extra ops: what a later patch adds", source)  # banner kept
        namespace: dict[str, Any] = {"Base": object}
        exec(compile(source, "x.py", "exec"), namespace)
        return namespace

    def test_a_held_back_section_leaves_stubs_for_its_hooks(self) -> None:
        namespace = self.staged(SECTIONED)
        wrapper = namespace["Wrapper"]()
        self.assertEqual(wrapper.run(), "core")
        self.assertEqual(namespace["after"](), "after the class")
        # Public methods and overrides of the base raise; helpers are gone.
        for hook in (wrapper.codegen_extra, wrapper._base_hook):
            with self.assertRaisesRegex(NotImplementedError, "extra ops: in a later"):
                hook()
        self.assertFalse(hasattr(wrapper, "_extra_helper"))
        # Nothing held back: the text is unchanged.
        self.assertEqual(_patches.hold_back(SECTIONED, [], frozenset(), "x"), SECTIONED)

    def test_a_helper_needed_before_its_section_stops_the_export(self) -> None:
        text = SECTIONED.replace("return self._spell()", "return self._extra_helper()")
        with self.assertRaisesRegex(_patches.PatchError, r"calls _extra_helper"):
            self.staged(text)

    def test_an_unknown_section_stops_the_export(self) -> None:
        with self.assertRaisesRegex(_patches.PatchError, "has no section 'nope'"):
            _patches.hold_back(SECTIONED, ["nope"], frozenset(), "x.py")


class TestPatchSeries(TestCase):
    def test_check_passes_on_the_committed_series(self) -> None:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = _patches.main(["check"])
        self.assertEqual(status, 0, err.getvalue())
        self.assertIn("is current and applies cleanly", out.getvalue())

    def test_series_lists_numbered_patches(self) -> None:
        names = _patches.read_series(SERIES)
        self.assertGreaterEqual(len(names), 2)
        for index, name in enumerate(names, start=1):
            self.assertTrue(
                name.startswith(f"{index:04d}-") and name.endswith(".patch")
            )
            text = (SERIES / name).read_text()
            self.assertRegex(
                text, rf"\nSubject: \[PATCH 0*{index}/{len(names)}\] \[inductor\] "
            )
            self.assertIn("diff --git a/torch/", text)

    def test_each_patch_is_small_or_one_file(self) -> None:
        # A patch over the limit adds a single module, which cannot be split.
        for name in _patches.read_series(SERIES):
            text = (SERIES / name).read_text()
            if _patches.changed_lines(text) > _patches.PATCH_LINE_LIMIT:
                self.assertEqual(len(_patches._touched_paths(text)), 1, name)

    def test_upstream_files_keep_their_names(self) -> None:
        # Nothing upstream is renamed or removed: importers outside the tree
        # (XPU, MTIA, PrivateUse1 backends) keep working.
        for name in _patches.read_series(SERIES):
            text = (SERIES / name).read_text()
            self.assertNotIn("\nrename from ", text, name)
            self.assertNotIn("\ndeleted file mode ", text, name)
            for path in _patches._touched_paths(text):
                self.assertFalse(
                    path.endswith(("/cpp_wrapper_cpu.py", "/cpp_wrapper_gpu.py")),
                    f"{name} changes upstream's {path}",
                )

    def test_a_module_in_no_patch_stops_the_export(self) -> None:
        without_spellings = tuple(
            patch
            for patch in _patches.SERIES
            if "_inductor/codegen/shim_args.py" not in patch.files
        )
        with (
            mock.patch.object(_patches, "SERIES", without_spellings),
            self.assertRaisesRegex(
                _patches.PatchError, r"torch_cppwrap/_inductor/codegen/shim_args.py"
            ),
        ):
            _patches.placements(_patches.Tree(SITE_PACKAGES))

    def test_our_classes_get_names_of_their_own(self) -> None:
        self.assertEqual(
            _patches.rename_classes("class CppWrapperGpu(CppWrapperCpu):", "x.py"),
            "class CppWrapperGpuJit(CppWrapperCpuJit):",
        )
        # Upstream's class would be renamed too: refused.
        with self.assertRaisesRegex(_patches.PatchError, "refers to upstream"):
            _patches.rename_classes(
                "from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu",
                "x.py",
            )

    def test_applying_leaves_the_installed_torch_alone(self) -> None:
        common = SITE_PACKAGES / "torch/_inductor/codegen/common.py"
        before = hashlib.sha256(common.read_bytes()).hexdigest()
        with tempfile.TemporaryDirectory() as tmp:
            tree = _patches.make_patched_torch(SERIES, SITE_PACKAGES, Path(tmp) / "t")
            patched = tree / "torch/_inductor/codegen/common.py"
            self.assertFalse(patched.is_symlink())
            # Files the series does not touch are links to the installed
            # torch, not copies.
            self.assertTrue((tree / "torch/_inductor/lowering.py").is_symlink())
            self.assertIn("aot_mode: bool = False", patched.read_text())
            codegen = tree / "torch/_inductor/codegen"
            self.assertTrue((codegen / "cpp_wrapper_cpu_jit.py").is_file())
            # Upstream's own wrappers are left as they are.
            self.assertTrue((codegen / "cpp_wrapper_cpu.py").is_symlink())
            self.assertTrue((codegen / "cpp_wrapper_gpu.py").is_symlink())
        self.assertEqual(hashlib.sha256(common.read_bytes()).hexdigest(), before)


class TestRewriteReferences(TestCase):
    NAMES = {
        "torch_cppwrap._inductor": "torch._inductor",
        "torch_cppwrap._inductor.codegen": "torch._inductor.codegen",
        "torch_cppwrap._inductor.codecache": "torch._inductor.cppwrap_codecache",
        "torch_cppwrap._compat": "torch._inductor.cppwrap_compat",
        "torch_cppwrap._C": "torch._inductor.runtime._C",
    }

    def rewrite(self, text: str) -> str:
        return _patches.rewrite_references(text, self.NAMES, "test.py")

    def test_imports_follow_each_module(self) -> None:
        self.assertEqual(
            self.rewrite("from torch_cppwrap import _compat\n"),
            "from torch._inductor import cppwrap_compat as _compat\n",
        )
        self.assertEqual(
            self.rewrite("from torch_cppwrap._inductor import codecache, codegen\n"),
            "from torch._inductor import cppwrap_codecache as codecache, codegen\n",
        )
        self.assertEqual(
            self.rewrite("    from torch_cppwrap._inductor.codecache import X\n"),
            "    from torch._inductor.cppwrap_codecache import X\n",
        )

    def test_names_in_strings_and_code(self) -> None:
        self.assertEqual(
            self.rewrite('#define CAPSULE "torch_cppwrap._C._api"\n'),
            '#define CAPSULE "torch._inductor.runtime._C._api"\n',
        )
        # Inside a function, the import must not make `torch` a local name.
        self.assertEqual(
            self.rewrite(
                "def f(m):\n    import torch_cppwrap\n\n    torch_cppwrap._C = m\n"
            ),
            "def f(m):\n    import torch._inductor.runtime as _runtime  # noqa: F401\n\n"
            "    torch._inductor.runtime._C = m\n",
        )

    def test_prose_is_left_alone(self) -> None:
        text = '"torch_cppwrap: not supported"  # generated by torch_cppwrap.\n'
        self.assertEqual(self.rewrite(text), text)
        # The package's public API has no upstream name; messages keep it.
        text = '"call torch_cppwrap.unpatch() first"\n'
        self.assertEqual(self.rewrite(text), text)

    def test_unmapped_module_is_an_error(self) -> None:
        with self.assertRaisesRegex(_patches.PatchError, "torch_cppwrap._patching"):
            self.rewrite("from torch_cppwrap import _patching\n")


# get_cpp_wrapper_config's default of autotune_at_compile_time, as torch 2.11,
# 2.12-2.14 and 2.15 spell it.
DEFAULTS = {
    "2.11": "else has_triton()",
    "2.12": """# Default to True for AOTI. Subject to change in future.
        else has_triton() and V.aot_compilation""",
    "2.15": """# Default to True for AOTI when an accelerator or the selected CPU
        # Triton backend is available. Subject to change in future.
        else (
            has_triton(include_cpu=config.cpu_backend == "triton") and V.aot_compilation
        )""",
}
COMPILE_FX = """
def get_cpp_wrapper_config() -> dict[str, object]:
    autotune_at_compile_time = (
        config.triton.autotune_at_compile_time
        if config.triton.autotune_at_compile_time is not None
        {default}
    )
    return {{"triton.autotune_at_compile_time": autotune_at_compile_time}}
"""


class TestCompileTimeTuning(TestCase):
    """The JIT wrapper for CUDA tunes Triton kernels while compiling: the
    series makes get_cpp_wrapper_config say so for every JIT graph where
    Triton is, and leaves AOTInductor's graphs to upstream's reading."""

    def edited(self, default: str) -> str:
        with tempfile.TemporaryDirectory() as root:
            path = Path(root, _patches.COMPILE_FX)
            path.parent.mkdir(parents=True)
            path.write_text(COMPILE_FX.format(default=default))
            tree = _patches.Tree(Path(root))
            _patches._tune_jit_graphs_at_compile_time(tree)
            return tree.read(_patches.COMPILE_FX)

    def setting_of(
        self, source: str, setting: bool | None, *, has_triton: bool, aot: bool
    ) -> object:
        class Triton:
            autotune_at_compile_time = setting

        class Config:
            triton = Triton
            cpu_backend = "cpp"

        class Virtualized:
            aot_compilation = aot

        namespace: dict[str, Any] = {
            "config": Config,
            "V": Virtualized,
            "has_triton": lambda include_cpu=False: has_triton,
        }
        exec(source, namespace)
        settings = namespace["get_cpp_wrapper_config"]()
        return settings["triton.autotune_at_compile_time"]

    def test_jit_graphs_are_tuned_while_compiling_where_triton_is(self) -> None:
        for release, default in DEFAULTS.items():
            source = self.edited(default)
            upstream = COMPILE_FX.format(default=default)
            cases = itertools.product((None, False, True), (False, True), (False, True))
            for setting, has_triton, aot in cases:
                with self.subTest(release, setting=setting, triton=has_triton, aot=aot):
                    ours, theirs = (
                        self.setting_of(text, setting, has_triton=has_triton, aot=aot)
                        for text in (source, upstream)
                    )
                    self.assertIs(ours, True if has_triton and not aot else theirs)

    def test_another_default_stops_the_export(self) -> None:
        with self.assertRaisesRegex(_patches.PatchError, "unexpected default"):
            self.edited("else V.aot_compilation")


class TestPatchedTorch(TestCase):
    """The seed example and friends under the patched torch, in a subprocess
    that never imports torch_cppwrap."""

    def run_patched(self, script: str) -> dict[str, Any]:
        """Runs `script` with the patched torch first on sys.path; returns the
        JSON its last line of output holds.  Its Inductor cache is kept
        between runs, as it holds the patched runtime extension and
        precompiled headers, with the FX graph and AOTAutograd caches off so
        that every graph is generated anew."""
        root = patched_torch()
        cache = SUITE_DIR / "inductor-patched"
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="patched-cwd-") as cwd:
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join(
                    [str(root), *filter(None, [os.environ.get("PYTHONPATH")])]
                ),
                # Leaves the installed torch's __pycache__ alone.
                "PYTHONDONTWRITEBYTECODE": "1",
                "TORCHINDUCTOR_CACHE_DIR": str(cache),
                "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
                "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
            }
            env.pop("TORCH_LOGS", None)
            proc = subprocess.run(
                [sys.executable, "-c", script],
                cwd=cwd,
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
        self.assertEqual(proc.returncode, 0, proc.stderr[-6000:])
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def test_compiles_with_the_patched_codegen(self) -> None:
        root = patched_torch()
        report = self.run_patched(PATCHED_TORCH_SCRIPT)

        self.assertTrue(report["torch_file"].startswith(str(root)))
        self.assertTrue(report["wrapper_file"].startswith(str(root)))
        self.assertFalse(report["torch_cppwrap_imported"])
        self.assertTrue(report["jit_is_ours"])
        self.assertTrue(report["aot_keeps_upstream"])
        for name, case in report["cases"].items():
            code = case["code"]
            self.assertGreaterEqual(case["wrappers_made"], 1, name)
            self.assertIn("from torch._inductor.cppwrap_codecache import", code)
            self.assertIn('#include "cppwrap_runtime.h"', code)
            self.assertIn("cppwrap::", code)
            self.assertNotIn("torch_cppwrap._inductor", code)
        self.assertIn("cpp_fused_add_sum_0(", report["cases"]["seed"]["code"])
        self.assertIn("aoti_torch_cpu_mm_out(", report["cases"]["mm"]["code"])
        # Written by our wrapper (its checked shim call), not by the node.
        self.assertRegex(
            report["cases"]["bernoulli"]["code"],
            r"CPPWRAP_CHECK_SHIM\(\"\S+\", aoti_torch_cpu_bernoulli__float\(",
        )

    @slowTest
    def test_aot_inductor_keeps_the_c_shim_wrapper(self) -> None:
        report = self.run_patched(AOT_SCRIPT)
        self.assertEqual(report["ours_made"], 0)
        self.assertGreaterEqual(report["upstream_made"], 1)
        self.assertFalse(report["torch_cppwrap_imported"])


if __name__ == "__main__":
    run_tests()
