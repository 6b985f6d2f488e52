"""scripts/gpu/host_cores.py: the host probe on each CPU."""

from __future__ import annotations

import os
import unittest

from torch._inductor.test_case import TestCase, run_tests

from tests.common import load_script

_host_cores = load_script("scripts/gpu/host_cores.py")


@unittest.skipUnless(hasattr(os, "sched_setaffinity"), "pinning needs Linux")
class TestHostCores(TestCase):
    def test_every_cpu_is_probed_and_the_process_put_back(self) -> None:
        allowed = os.sched_getaffinity(0)
        rows = _host_cores.scan(passes=2)
        self.assertEqual(os.sched_getaffinity(0), allowed)
        self.assertEqual([row["cpu"] for row in rows], sorted(allowed))
        for row in rows:
            self.assertEqual(len(row["probe_us"]), 2)
            self.assertGreater(min(row["probe_us"]), 0.0)
        best = _host_cores.fastest(rows)
        self.assertEqual(
            min(row["median_us"] for row in rows),
            next(row["median_us"] for row in rows if row["cpu"] == best),
        )
        self.assertIn(f"fastest: CPU {best}", _host_cores.table(rows))


if __name__ == "__main__":
    run_tests()
