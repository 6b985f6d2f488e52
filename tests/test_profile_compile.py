"""scripts/gpu/profile_compile.py: one cold compile under cProfile."""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

from torch._inductor.test_case import TestCase, run_tests

from tests.common import load_script

_profile_compile = load_script("scripts/gpu/profile_compile.py")


def _slow_compile() -> None:
    time.sleep(0.05)


def _fake_worker(
    workload: str, mode: str, phase: str, device: str, quick: bool
) -> dict:
    _slow_compile()
    return {"compile_s": 0.05, "ok": True, "wrappers": [mode], "phase": phase}


class TestProfileCompile(TestCase):
    def test_the_cold_step_is_profiled_and_written(self) -> None:
        bench = SimpleNamespace(run_worker=mock.Mock(side_effect=_fake_worker))
        with (
            tempfile.TemporaryDirectory() as out,
            mock.patch.object(_profile_compile, "load_bench", return_value=bench),
        ):
            _profile_compile._child("seed", "python", Path(out), "cpu")
            bench.run_worker.assert_called_once_with(
                "seed", "python", "cold", "cpu", True
            )
            text = (Path(out) / "seed_python.txt").read_text()
            self.assertTrue((Path(out) / "seed_python.prof").is_file())
        self.assertTrue(text.startswith("compile_s 0.05\n"), text[:200])
        # The worker's work is in the profile, by cumulative and own time.
        self.assertIn("_slow_compile", text)
        self.assertIn("Ordered by: cumulative time", text)
        self.assertIn("Ordered by: internal time", text)

    def test_each_mode_compiles_in_its_own_fresh_cache(self) -> None:
        calls = []

        def run(cmd: list[str], env: dict[str, str], **kwargs: object) -> object:
            calls.append((cmd, env))
            self.assertTrue(Path(env["TORCHINDUCTOR_CACHE_DIR"]).is_dir())
            return subprocess.CompletedProcess(cmd, 0, stdout='{"ok": true}\n')

        argv = ["profile_compile.py", "--device", "cpu", "--workloads", "seed"]
        with (
            tempfile.TemporaryDirectory() as out,
            mock.patch.object(_profile_compile.subprocess, "run", side_effect=run),
            mock.patch(
                "sys.argv", [*argv, "--modes", "python,cppwrap-no-replay", "--out", out]
            ),
        ):
            _profile_compile.main()
        self.assertEqual(
            [cmd[-2:] for cmd, _ in calls],
            [["seed", "python"], ["seed", "cppwrap-no-replay"]],
        )
        first, second = (env for _, env in calls)
        self.assertNotEqual(
            first["TORCHINDUCTOR_CACHE_DIR"], second["TORCHINDUCTOR_CACHE_DIR"]
        )
        self.assertNotIn("TORCH_CPPWRAP_CUDA_GRAPHS", first)
        self.assertEqual(second["TORCH_CPPWRAP_CUDA_GRAPHS"], "0")
        self.assertFalse(Path(first["TORCHINDUCTOR_CACHE_DIR"]).exists())


if __name__ == "__main__":
    run_tests()
