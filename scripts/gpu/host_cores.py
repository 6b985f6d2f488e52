"""How fast the host is on each CPU this process may run on.

The bench's warm processes of one device lease found the host up to 2x
apart by its host probe (an eager in-place add on a 0-d CPU tensor,
bench.py's host_probe_us), process to process.  This runs that probe pinned
to each CPU in turn, `--passes` times over, and prints a table: the CPU, its
NUMA node and hyperthread siblings, the probe's fastest, median and slowest
pass.  CPUs slow in every scan would be a place to keep the bench's
timing away from (its `--timing-cpu` pins it to one CPU); CPUs slow in one
scan and fast in the next are a host that slows down in spells, as the
H200's did in session 24, which only more rounds of the bench steady.
`--print-fastest` prints just the CPU whose median is lowest, for a
script:

    python scripts/gpu/host_cores.py --out host_cores.json
    CPU=$(python scripts/gpu/host_cores.py --print-fastest 2>/dev/null)
    python benchmarks/bench.py --device cuda --timing-cpu "$CPU" ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_call import load_bench


def _cpu_file(cpu: int, name: str) -> str | None:
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}") / name
    try:
        return path.read_text().strip()
    except OSError:
        return None


def numa_node(cpu: int) -> int | None:
    nodes = sorted(Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node[0-9]*"))
    return int(nodes[0].name[4:]) if nodes else None


def scan(passes: int) -> list[dict[str, Any]]:
    """One row per CPU this process may run on, with the probe's µs of each
    pass pinned there; the process's CPUs are put back afterwards."""
    bench = load_bench()
    allowed = os.sched_getaffinity(0)
    cpus = sorted(allowed)
    probes: dict[int, list[float]] = {cpu: [] for cpu in cpus}
    try:
        for _ in range(passes):
            for cpu in cpus:
                os.sched_setaffinity(0, {cpu})
                probes[cpu].append(bench.host_probe_us(bench.FULL))
    finally:
        os.sched_setaffinity(0, allowed)
    return [
        {
            "cpu": cpu,
            "numa_node": numa_node(cpu),
            "siblings": _cpu_file(cpu, "topology/thread_siblings_list"),
            "probe_us": probes[cpu],
            "median_us": statistics.median(probes[cpu]),
        }
        for cpu in cpus
    ]


def fastest(rows: list[dict[str, Any]]) -> int:
    return min(rows, key=lambda row: row["median_us"])["cpu"]


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| CPU | NUMA node | siblings | probe µs fastest / median / slowest |",
        "|--:|--:|---|--:|",
    ]
    for row in rows:
        p = row["probe_us"]
        lines.append(
            f"| {row['cpu']} | {row['numa_node']} | {row['siblings']} | "
            f"{min(p):.2f} / {row['median_us']:.2f} / {max(p):.2f} |"
        )
    medians = [row["median_us"] for row in rows]
    lines.append(
        f"\nmedians {min(medians):.2f}-{max(medians):.2f} µs "
        f"({max(medians) / min(medians):.2f}x); fastest: CPU {fastest(rows)}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument(
        "--print-fastest",
        action="store_true",
        help="print only the fastest CPU on stdout (the table goes to stderr)",
    )
    ns = parser.parse_args(argv)
    if ns.passes < 1:
        parser.error(f"--passes must be at least 1, got {ns.passes}")
    if not hasattr(os, "sched_setaffinity"):
        parser.error("pinning to a CPU needs Linux (os.sched_setaffinity)")
    rows = scan(ns.passes)
    if ns.out is not None:
        ns.out.write_text(json.dumps(rows, indent=1) + "\n")
    if ns.print_fastest:
        print(table(rows), file=sys.stderr)
        print(fastest(rows))
    else:
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
