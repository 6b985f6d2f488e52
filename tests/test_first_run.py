"""What a new user meets first: the install's dependencies, the command line,
and what the first build says while it runs."""

from __future__ import annotations

import sys
import unittest
from pathlib import Path

from torch._inductor.test_case import TestCase, run_tests

REPO = Path(__file__).resolve().parent.parent


class TestInstall(TestCase):
    @unittest.skipIf(sys.version_info < (3, 11), "tomllib is new in Python 3.11")
    def test_numpy_is_installed_with_the_package(self) -> None:
        # Without numpy, importing torch warns "Failed to initialize NumPy".
        import tomllib

        with open(REPO / "pyproject.toml", "rb") as f:
            dependencies = tomllib.load(f)["project"]["dependencies"]
        self.assertIn("numpy", [d.split(">")[0].split("=")[0] for d in dependencies])


if __name__ == "__main__":
    run_tests()
