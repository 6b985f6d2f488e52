"""A damaged or unusual code cache, in the spirit of upstream's
test/inductor/test_codecache.py.

Every case runs its builds in subprocesses with their own
TORCHINDUCTOR_CACHE_DIR under a temporary directory (never the user's
cache), seeded with the suite's runtime extension and precompiled headers:
hard links, or copies for the files a case damages.  Run the group alone with
``pytest tests/test_cache_damage.py`` (or ``-k TestCacheDamage``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

from torch._inductor.test_case import TestCase, run_tests

from tests.common import IDENTITY_SOURCE, seed_cache
from torch_cppwrap._inductor import codecache

REPO = Path(__file__).resolve().parent.parent

# Loads a module built from the wrapper source argv[1] and the kernel source
# argv[2], checks that it runs, and reports its path and torch_cppwrap's
# warnings on the last line.  torch_cppwrap logs each build it makes.
CASE = r"""
import json, logging, sys, warnings
logging.basicConfig(format="%(message)s")
logging.getLogger("torch_cppwrap").setLevel(logging.INFO)
import torch
import torch_cppwrap
from torch_cppwrap._inductor.codecache import CppWrapperCodeCache

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    module = CppWrapperCodeCache.load(sys.argv[1], sys.argv[2])
x = torch.randn(3)
(out,) = module.call([x])
assert out is x
print("RESULT " + json.dumps({
    "module": module.__file__,
    "warnings": [str(w.message) for w in caught if "torch_cppwrap" in str(w.message)],
}))
"""

KERNEL_SOURCE = """
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C" void damage_test_kernel_%s(float* out) { out[0] = 1.0f; }
"""


def graph(tag: str, kernels: bool = False) -> tuple[str, str]:
    return IDENTITY_SOURCE % {"tag": tag}, KERNEL_SOURCE % tag if kernels else ""


def garble(path: Path) -> None:
    """Overwrites bytes in the middle of `path`, keeping its size."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = bytes(
        (b ^ 0x5A) for b in data[middle : middle + 4096]
    )
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


class TestCacheDamage(TestCase):
    def setUp(self) -> None:
        super().setUp()
        self._tmp = tempfile.TemporaryDirectory(prefix="cppwrap-damage-")
        self.addCleanup(self._tmp.cleanup)
        self.tmp = Path(self._tmp.name)
        self.cache = self.tmp / "inductor"

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("TORCH_LOGS", None)
        env.update(
            PYTHONPATH=os.pathsep.join(
                filter(None, [str(REPO), env.get("PYTHONPATH")])
            ),
            TORCHINDUCTOR_CACHE_DIR=str(self.cache),
            # Trust /proc/cpuinfo, as the parent's probe did, instead of
            # probing the vector ISA again in every fresh cache.
            TORCHINDUCTOR_VEC_ISA_OK="1",
        )
        env.update(extra)
        return env

    def seed(self, *, copies: tuple[str, ...] = (), pch: bool = True) -> None:
        """Seeds the case's cache; without `pch`, with the runtime extension
        only, so that the case builds the precompiled headers."""
        with mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": str(self.cache)}):
            seed_cache(copies=copies)
            if not pch:
                for gch in (self.cache / "cppwrap" / "pch").rglob("*"):
                    if gch.is_file():
                        gch.unlink()

    def run_case(
        self, wrapper: str, kernels: str = "", *, cwd: Path | None = None, **env: str
    ) -> tuple[dict[str, Any], str]:
        proc = subprocess.run(
            [sys.executable, "-c", CASE, wrapper, kernels],
            env=self.env(**env),
            cwd=cwd or self.tmp,
            capture_output=True,
            text=True,
            timeout=600,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
        line = proc.stdout.strip().splitlines()[-1]
        self.assertTrue(line.startswith("RESULT "), proc.stdout[-2000:])
        return json.loads(line[len("RESULT ") :]), proc.stderr

    def artefact(self, pattern: str) -> Path:
        (path,) = (self.cache / "cppwrap").rglob(pattern)
        return path

    def assert_rebuilt_once(
        self, damaged: Path, wrapper: str, kernels: str = ""
    ) -> None:
        """The next process warns once, naming `damaged`, rebuilds it and
        works; the one after finds it intact and says nothing."""
        result, _ = self.run_case(wrapper, kernels)
        self.assertEqual(len(result["warnings"]), 1, result["warnings"])
        self.assertIn(str(damaged), result["warnings"][0])
        self.assertIn("rebuilding", result["warnings"][0])
        self.assertIsNone(codecache._damage(damaged))
        result, stderr = self.run_case(wrapper, kernels)
        self.assertEqual(result["warnings"], [])
        self.assertNotIn("torch_cppwrap: built", stderr)

    def test_space_and_non_ascii_in_cache_dir_and_home(self) -> None:
        # cpp_builder does not quote the file names it puts in a command line.
        self.cache = self.tmp / "cache dir é ü" / "inductor"
        self.seed(pch=False)
        home = self.tmp / "home dir ö"
        home.mkdir()
        result, stderr = self.run_case(*graph("space", kernels=True), HOME=str(home))
        self.assertTrue(result["module"].startswith(str(self.cache)))
        self.assertEqual(result["warnings"], [])
        self.assertIn("building the precompiled cppwrap_runtime.h", stderr)
        self.assertIn("building the precompiled cpp_prefix.h", stderr)

    def test_truncated_graph_module_is_rebuilt_once(self) -> None:
        self.seed()
        result, _ = self.run_case(*graph("truncated"))
        module = Path(result["module"])
        truncate(module)  # was: ImportError "file too short", in every process
        self.assert_rebuilt_once(module, *graph("truncated"))

    def test_garbled_graph_module_is_rebuilt_once(self) -> None:
        self.seed()
        result, _ = self.run_case(*graph("garbled"))
        module = Path(result["module"])
        garble(module)  # was: SIGSEGV in every process that loaded it
        self.assert_rebuilt_once(module, *graph("garbled"))

    def test_garbled_precompiled_header_is_rebuilt_once(self) -> None:
        self.seed(copies=("cppwrap_runtime.h.gch",))
        header = self.artefact("cppwrap_runtime.h.gch")
        garble(header)  # was: gcc failing on it in every later build
        self.assert_rebuilt_once(header, *graph("garbled_header"))

    def test_truncated_precompiled_header_is_rebuilt_once(self) -> None:
        self.seed(copies=("cpp_prefix.h.gch",))
        header = self.artefact("cpp_prefix.h.gch")
        truncate(header)
        self.assert_rebuilt_once(header, *graph("truncated_header", kernels=True))

    def test_build_left_by_a_killed_process_is_cleaned(self) -> None:
        self.seed()
        wrapper, kernels = graph("killed", kernels=True)
        proc = subprocess.Popen(
            [sys.executable, "-c", CASE, wrapper, kernels],
            env=self.env(),
            cwd=self.tmp,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 300
            while not list((self.cache / "cppwrap").rglob(".build-*")):
                self.assertIsNone(proc.poll(), "the build finished before the kill")
                self.assertLess(time.monotonic(), deadline)
                time.sleep(0.02)
            time.sleep(0.5)  # the compilers are running
            self.assertIsNone(proc.poll(), "the build finished before the kill")
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the compilers too
            proc.wait()
        self.assertTrue(list((self.cache / "cppwrap").rglob(".build-*")))
        result, _ = self.run_case(wrapper, kernels)
        self.assertEqual(result["warnings"], [])
        self.assertFalse(list((self.cache / "cppwrap").rglob(".build-*")))

    def test_concurrent_cold_builds_build_each_artefact_once(self) -> None:
        self.seed(pch=False)
        wrapper, kernels = graph("concurrent", kernels=True)
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", CASE, wrapper, kernels],
                env=self.env(),
                cwd=self.tmp,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(4)
        ]
        outputs = [proc.communicate(timeout=600) for proc in procs]
        for proc, (_, err) in zip(procs, outputs, strict=True):
            self.assertEqual(proc.returncode, 0, err[-4000:])
        stderr = "".join(err for _, err in outputs)
        self.assertEqual(
            stderr.count("building the precompiled cppwrap_runtime.h ("), 1
        )
        self.assertEqual(stderr.count("building the precompiled cpp_prefix.h ("), 1)
        self.assertEqual(stderr.count("torch_cppwrap: built cppwrap_"), 1)
        modules = {json.loads(out.splitlines()[-1][7:])["module"] for out, _ in outputs}
        self.assertEqual(len(modules), 1)

    def test_empty_cppwrap_cache_dir_variable_writes_nothing_in_cwd(self) -> None:
        # TORCH_CPPWRAP_CACHE_DIR="" once built into the current directory;
        # the variable is gone, and the cache is Inductor's.
        self.seed()
        cwd = self.tmp / "cwd"
        cwd.mkdir()
        result, _ = self.run_case(*graph("cwd"), cwd=cwd, TORCH_CPPWRAP_CACHE_DIR="")
        self.assertTrue(result["module"].startswith(str(self.cache)))
        self.assertEqual(list(cwd.iterdir()), [])


if __name__ == "__main__":
    run_tests()
