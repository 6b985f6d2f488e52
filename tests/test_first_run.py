"""What a new user meets first: the install's dependencies, the command line,
and what the first build says while it runs."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path
from unittest import mock

import torch
from torch._inductor.test_case import TestCase, run_tests

import torch_cppwrap
from tests.common import seed_cache
from torch_cppwrap._inductor import codecache

REPO = Path(__file__).resolve().parent.parent


class TestInstall(TestCase):
    @unittest.skipIf(sys.version_info < (3, 11), "tomllib is new in Python 3.11")
    def test_numpy_is_installed_with_the_package(self) -> None:
        # Without numpy, importing torch warns "Failed to initialize NumPy".
        import tomllib

        with open(REPO / "pyproject.toml", "rb") as f:
            dependencies = tomllib.load(f)["project"]["dependencies"]
        self.assertIn("numpy", [d.split(">")[0].split("=")[0] for d in dependencies])

    @unittest.skipIf(sys.version_info < (3, 11), "tomllib is new in Python 3.11")
    def test_triton_comes_with_the_cuda_extra_only(self) -> None:
        # The CUDA wrapper needs it; a CPU install must not pull it in.
        import tomllib

        with open(REPO / "pyproject.toml", "rb") as f:
            project = tomllib.load(f)["project"]
        extras = project["optional-dependencies"]
        self.assertIn("triton", extras["cuda"])
        for name, requirements in [("dependencies", project["dependencies"])] + [
            (extra, extras[extra]) for extra in extras if extra != "cuda"
        ]:
            self.assertFalse(any(r.startswith("triton") for r in requirements), name)


class TestCommandLine(TestCase):
    def run_cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        # -X importtime lists every module the command imports, on stderr.
        return subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "torch_cppwrap", *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )

    def test_help_and_version_do_not_import_torch(self) -> None:
        for args in (["--help"], ["--version"], ["demo", "--help"]):
            proc = self.run_cli(*args)
            self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
            imported = [
                line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
            ]
            self.assertFalse("torch" in imported, f"{args} imported torch")
        self.assertEqual(
            self.run_cli("--version").stdout.split()[:2],
            ["torch_cppwrap", torch_cppwrap.__version__],
        )


class TestInstalledRuntime(TestCase):
    """`python -m torch_cppwrap build` installs the runtime extension and the
    precompiled headers, and a compile in a new Inductor cache then uses them
    instead of building its own."""

    def setUp(self) -> None:
        super().setUp()
        seed_cache()  # this cache holds the suite's runtime extension
        self.installed = Path(tempfile.mkdtemp(prefix="installed-runtime-"))
        self.addCleanup(shutil.rmtree, self.installed, ignore_errors=True)
        self.env = {codecache.INSTALLED_RUNTIME_ENV: str(self.installed)}

    def test_build_installs_this_caches_extension_and_compiles_use_it(self) -> None:
        # Where CUDA is available, `build` installs the CUDA wrapper's
        # precompiled header too: this cache holds that one as well.
        devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
        for device_type in devices:
            seed_cache(device_type)
        env = dict(os.environ, **self.env)
        proc = subprocess.run(
            [sys.executable, "-m", "torch_cppwrap", "build"],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        self.assertIn("precompiled headers are installed in", proc.stderr)
        # The same keys as this cache's: copied, not built again.
        self.assertNotIn("torch_cppwrap: building", proc.stderr)
        from torch._inductor import config as inductor_config

        headers = codecache._is_gcc() and inductor_config.cpp_cache_precompile_headers
        # cppwrap_runtime.h per device, and cpp_prefix.h for CPU kernels.
        expected = len(devices) + 1 if headers else 0
        self.assertEqual(len(list(self.installed.rglob("*.gch"))), expected)
        (installed,) = self.installed.rglob("cppwrap_runtime.so")
        _, cached = codecache.RuntimeExtension.artefact()
        self.assertEqual(installed.read_bytes(), cached.read_bytes())
        with mock.patch.dict(os.environ, self.env):
            self.assertEqual(codecache.RuntimeExtension.ensure_built(), installed)
            # One that is damaged is passed over, with a warning naming it.
            installed.write_bytes(b"not a shared library")
            with self.assertWarnsRegex(UserWarning, "installed .*cppwrap_runtime.so"):
                self.assertEqual(codecache.RuntimeExtension.ensure_built(), cached)

    def test_a_compile_in_a_new_cache_loads_the_installed_extension(self) -> None:
        with mock.patch.dict(os.environ, self.env):
            codecache.prepare_runtime("cpu", install=True)
            installed = codecache.RuntimeExtension.ensure_built()
        fresh = tempfile.mkdtemp(prefix="fresh-inductor-cache-")
        self.addCleanup(shutil.rmtree, fresh, ignore_errors=True)
        # It also finds the compile commands the installation recorded, and
        # makes none of cpp_builder's options (which probe the compiler).
        script = (
            "import torch, torch_cppwrap, sys\n"
            "from torch_cppwrap._inductor import codecache\n"
            "made = []\n"
            "real = codecache._compat.build_options\n"
            "def spy(*args, **kwargs):\n"
            "    made.append(kwargs)\n"
            "    return real(*args, **kwargs)\n"
            "codecache._compat.build_options = spy\n"
            "torch._inductor.config.cpp_wrapper = True\n"
            "x = torch.randn(8, 8)\n"
            "out = torch.compile(lambda x: (x + 1).sum())(x)\n"
            "assert torch.allclose(out, (x + 1).sum())\n"
            "print(sys.modules['torch_cppwrap._C'].__file__)\n"
            "print('options made:', made)\n"
        )
        env = dict(os.environ, **self.env, TORCHINDUCTOR_CACHE_DIR=fresh)
        proc = subprocess.run(
            [sys.executable, "-c", script],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        self.assertEqual(proc.stdout.splitlines(), [str(installed), "options made: []"])
        # Neither the runtime extension nor a precompiled header was built.
        self.assertNotIn("torch_cppwrap: building", proc.stderr)


class TestFirstBuildMessages(TestCase):
    def test_first_build_says_what_it_builds_and_how_long(self) -> None:
        if not codecache._is_gcc():
            self.skipTest("precompiled headers are built with gcc only")
        build = codecache.Build("header", ("tiny.h",), (("precompiling", True),))
        messages = []
        with tempfile.TemporaryDirectory() as tmp:
            header = Path(tmp, "tiny.h")
            header.write_text("inline int tiny() { return 1; }\n")
            for _ in range(2):
                stderr = io.StringIO()
                # As a new process would start: nothing checked yet.
                with (
                    mock.patch.object(codecache, "_intact", set()),
                    contextlib.redirect_stderr(stderr),
                ):
                    codecache.precompiled_header_dir(header, "tiny.h", build, "digest")
                messages.append(stderr.getvalue().splitlines())
        first, later = messages
        self.assertEqual(len(first), 2, first)
        self.assertRegex(
            first[0],
            r"^torch_cppwrap: building the precompiled tiny.h "
            r"\(once per Inductor cache\)\.\.\.$",
        )
        self.assertRegex(first[1], r"^torch_cppwrap: building .*: done in \d+\.\d s$")
        self.assertEqual(later, [])  # built once: later runs say nothing

    def step_messages(self, remove_build_dir: bool) -> list[str]:
        stderr = io.StringIO()
        with tempfile.TemporaryDirectory() as tmp:
            build_dir = Path(tmp, "build")
            build_dir.mkdir()
            with (
                contextlib.redirect_stderr(stderr),
                self.assertRaisesRegex(RuntimeError, "no such header"),
                codecache._first_use_step("building it", "once", build_dir),
            ):
                if remove_build_dir:
                    build_dir.rmdir()
                raise RuntimeError("no such header\nthe rest of the log")
        return stderr.getvalue().splitlines()

    def test_a_failed_build_says_why(self) -> None:
        started, failed = self.step_messages(remove_build_dir=False)
        self.assertEqual(started, "torch_cppwrap: building it (once)...")
        self.assertRegex(
            failed,
            r"^torch_cppwrap: building it: failed after \d+\.\d s: no such header$",
        )

    def test_a_build_whose_cache_was_removed_fails_quietly(self) -> None:
        # fresh_cache() deletes the cache while a prefetch still builds into
        # it: the build is abandoned, and that is no news for stderr.
        self.assertEqual(
            self.step_messages(remove_build_dir=True),
            ["torch_cppwrap: building it (once)..."],
        )


if __name__ == "__main__":
    run_tests()
