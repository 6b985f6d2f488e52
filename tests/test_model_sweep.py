"""benchmarks/model_sweep.py: real models through our wrapper, against eager."""

from __future__ import annotations

import json
import tempfile
import unittest
from pathlib import Path
from unittest import mock

from torch._dynamo.utils import counters
from torch._inductor.test_case import TestCase, run_tests

from tests.common import HAS_TRANSFORMERS, load_script, seed_cache
from torch_cppwrap._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

_sweep = load_script("benchmarks/model_sweep.py")


class TestCommandLine(TestCase):
    def test_unknown_model_and_setting_are_named(self) -> None:
        with self.assertRaisesRegex(SystemExit, "unknown or unavailable models: nope"):
            _sweep.main(["--models", "llama,nope"])
        with mock.patch("sys.stderr"), self.assertRaises(SystemExit) as raised:
            _sweep.main(["--settings", "default,fast"])
        self.assertEqual(raised.exception.code, 2)  # argparse's error


@unittest.skipUnless(HAS_TRANSFORMERS, "needs transformers")
class TestSweep(TestCase):
    def setUp(self) -> None:
        super().setUp()
        seed_cache()

    def sweep(self, *argv: str) -> tuple[int, list[dict], str]:
        with tempfile.TemporaryDirectory() as out:
            code = _sweep.main([*argv, "--out", out])
            rows = json.loads((Path(out) / "sweep.json").read_text())
            return code, rows, (Path(out) / "sweep.md").read_text()

    def test_a_model_compiles_with_ours_and_matches(self) -> None:
        counters.clear()
        code, rows, text = self.sweep(
            "--models", "opt", "--settings", "default,backward,compiled_autograd"
        )
        self.assertEqual(code, 0)
        self.assertEqual(
            [(r["model"], r["setting"], r["status"]) for r in rows],
            [
                ("opt", "default", "ok"),
                ("opt", "backward", "ok"),
                ("opt", "compiled_autograd", "ok"),
            ],
        )
        self.assertEqual(rows[0]["graphs"], 1)
        self.assertEqual(rows[1]["graphs"], 2)  # forward and backward
        # The forward, and the backward compiled autograd traced.
        self.assertEqual(rows[2]["graphs"], 2)
        self.assertEqual(counters["compiled_autograd"]["captures"], 1)
        self.assertIn("3 of 3 cases", text)

    def test_a_mismatch_and_a_fallback_are_rows_not_crashes(self) -> None:
        with mock.patch.object(_sweep.bench, "compare", return_value=(False, 0.5)):
            code, rows, _ = self.sweep("--models", "opt", "--settings", "default")
        self.assertEqual(code, 1)
        self.assertEqual(rows[0]["status"], "mismatch")
        # The case ran again through the Python wrapper, whose error the row
        # gives beside ours'.
        self.assertEqual(
            rows[0]["message"],
            "max error 0.5; the Python wrapper's 0.5 (also a mismatch)",
        )
        self.assertEqual(rows[0]["python_max_err"], 0.5)
        # strict: a graph ours cannot handle raises, and the case says why.
        gap = NotImplementedError("torch_cppwrap: a gap in our wrapper")
        with mock.patch.object(CppWrapperCpu, "create", side_effect=gap):
            code, rows, _ = self.sweep("--models", "opt", "--settings", "default")
        self.assertEqual(code, 1)
        self.assertEqual(rows[0]["status"], "error")
        self.assertIn("a gap in our wrapper", rows[0]["message"])


if __name__ == "__main__":
    run_tests()
