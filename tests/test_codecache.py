"""torch_cppwrap's CppWrapperCodeCache: keys, memo, disk cache, errors."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path
from unittest import mock

from torch._inductor.test_case import TestCase, run_tests

import torch_cppwrap  # noqa: F401
from torch_cppwrap._inductor import codecache
from torch_cppwrap._inductor.codecache import (
    CppWrapperCodeCache,
    CppWrapperCompileError,
    sha256_hex,
)

# A minimal wrapper module: no kernels, returns its single input.
IDENTITY_SOURCE = """
#include "cppwrap_runtime.h"

CPPWRAP_MODULE_STATE()

static PyObject* call_impl(PyObject* /*module*/, PyObject* args) {
    if (!cppwrap::check_args(args, 1)) return nullptr;
    cppwrap::Tensor x;
    if (!cppwrap::unpack_tensor(args, 0, x, "x")) return nullptr;
    cppwrap::clear_args(args);
    return cppwrap::pack_outputs<1>({cppwrap::output(x)});
}

CPPWRAP_DEFINE_MODULE("test module %(tag)s")
"""


class TestCodeCache(TestCase):
    def setUp(self) -> None:
        super().setUp()
        self._tmp = tempfile.TemporaryDirectory()
        self._env = mock.patch.dict(
            os.environ, {"TORCHINDUCTOR_CACHE_DIR": self._tmp.name}
        )
        self._env.start()
        CppWrapperCodeCache.cache_clear()

    def tearDown(self) -> None:
        self._env.stop()
        self._tmp.cleanup()
        CppWrapperCodeCache.cache_clear()
        super().tearDown()

    def test_vec_isa_probe_is_asked_once_per_machine(self) -> None:
        probes: list[str] = []

        class FakeIsa:
            def __init__(self, name: str) -> None:
                self.name = name

            def __str__(self) -> str:
                return self.name

            def build_arch_flags(self) -> str:
                return f"-m{self.name}"

        def check_build(isa: FakeIsa, code: str) -> bool:
            probes.append(str(isa))
            return str(isa) == "avx2"

        remembered = codecache.remember_vec_isa_probe(check_build)
        with (
            tempfile.TemporaryDirectory() as cache,
            tempfile.TemporaryDirectory() as other_inductor_cache,
            mock.patch.dict(os.environ, {"TORCH_CPPWRAP_CACHE_DIR": cache}),
        ):
            answers = [
                remembered(FakeIsa(name), "int main() {}")
                for name in ("avx2", "avx512", "avx2", "avx512")
            ]
            with mock.patch.dict(
                os.environ, {"TORCHINDUCTOR_CACHE_DIR": other_inductor_cache}
            ):
                self.assertTrue(remembered(FakeIsa("avx2"), "int main() {}"))
            # Other test code is another question.
            remembered(FakeIsa("avx2"), "int main() { return 1; }")
        self.assertEqual(answers, [True, False, True, False])
        self.assertEqual(probes, ["avx2", "avx512", "avx2"])

    def test_sha256_parts_are_length_prefixed(self) -> None:
        self.assertNotEqual(sha256_hex("ab", "c"), sha256_hex("a", "bc"))
        self.assertEqual(len(sha256_hex("x")), 64)

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
        with mock.patch.object(codecache, "_run_parallel", side_effect=AssertionError):
            again = CppWrapperCodeCache.load(source)
        self.assertEqual(again.__file__, module.__file__)
        so_files = list(Path(self._tmp.name, "cppwrap").rglob("*.so"))
        self.assertEqual(len(so_files), 1)
        # No temporary build directories or lock leftovers hold the .so.
        self.assertFalse(list(Path(self._tmp.name, "cppwrap").rglob(".build-*")))

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
        self.assertFalse(list(Path(self._tmp.name, "cppwrap").rglob("*.so")))

    def test_concurrent_loads_build_once(self) -> None:
        source = IDENTITY_SOURCE % {"tag": "threads"}
        calls = []
        real = codecache._run_parallel

        def counting(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)

        results = []
        with mock.patch.object(codecache, "_run_parallel", counting):
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

    def test_lock_timeout_is_a_clear_error(self) -> None:
        from filelock import FileLock

        target = Path(self._tmp.name) / "artefact.so"
        with (
            FileLock(str(target) + ".lock"),
            mock.patch.object(codecache, "LOCK_TIMEOUT_S", 0.2),
        ):
            result: list[BaseException] = []

            def build_in_thread() -> None:
                try:
                    codecache._build_once(target, lambda d: d / "x", "a test artefact")
                except BaseException as e:
                    result.append(e)

            t = threading.Thread(target=build_in_thread)
            t.start()
            t.join()
        self.assertEqual(len(result), 1)
        self.assertIn("timed out", str(result[0]))
        self.assertIn("a test artefact", str(result[0]))


if __name__ == "__main__":
    run_tests()
