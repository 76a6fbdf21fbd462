"""How fast the command line answers when it has nothing to compute, against ``import torch``.

Times, in fresh processes and interleaved round by round (the machine is shared and noisy):

* ``convnets --help``
* ``convnets predict --help``
* a usage error (``convnets predict --model resnet05 x.jpg``: exit status 2)
* the three mistakes of issue 25, checked before PyTorch (exit status 2): a misspelt input
  (``predict exmaples/``), an output in a missing directory, an unknown output format
  (``embed --output vec.txt``)
* an output that another run holds (issue 26: ``predict --output FILE`` while this script holds
  ``FILE.lock``; exit status 1)
* ``python -c "import torch"``, the reference

and prints each median wall time and its ratio to the reference. Target (issue 11): help and
usage errors take less than half of ``import torch``. tests/test_cli_startup.py and
tests/test_outputs_hardening.py check the cause (no PyTorch imported) without timing anything.

    python benchmarks/bench_cli.py [--rounds 7] [--json FILE]

Results go to ``benchmarks/results/bench_cli.json`` (see ``benchmarks/results.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import results  # noqa: E402  (benchmarks/results.py)

TARGET = 0.5

CLI = [sys.executable, "-m", "convnets"]
#: The held output's lock, held by this script while it times (paths are relative to the repository).
HELD = Path(tempfile.gettempdir()) / f"bench_cli-{os.getpid()}.jsonl"

#: name -> (command line, expected exit status)
CASES: dict[str, tuple[list[str], int]] = {
    "convnets --help": ([*CLI, "--help"], 0),
    "convnets predict --help": ([*CLI, "predict", "--help"], 0),
    "usage error": ([*CLI, "predict", "--model", "resnet05", "x.jpg"], 2),
    "misspelt input": ([*CLI, "predict", "exmaples/"], 2),
    "output in a missing directory": ([*CLI, "predict", "--output", "no/such/dir/out.jsonl", "examples"], 2),
    "unknown output format": ([*CLI, "embed", "--output", "vec.txt", "examples"], 2),
    "held output": ([*CLI, "predict", "--output", str(HELD), "examples"], 1),
    "import torch": ([sys.executable, "-c", "import torch"], 0),
}
REFERENCE = "import torch"


def _time(cmd: list[str], expected: int, env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, env=env, cwd=REPO)
    seconds = time.perf_counter() - start
    if proc.returncode != expected:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}, expected {expected}:\n"
                         f"{proc.stderr.decode(errors='replace')}")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed runs of each case (default: 7)")
    results.add_output_option(parser, "bench_cli")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    sys.path.insert(0, str(REPO))
    from convnets.fileio import exclusive_lock

    times: dict[str, list[float]] = {name: [] for name in CASES}
    with exclusive_lock(HELD.with_name(HELD.name + ".lock"), timeout=0):  # as a running predict holds it
        for cmd, expected in CASES.values():  # untimed: fill the page cache with every module once
            _time(cmd, expected, env)
        for _ in range(args.rounds):
            for name, (cmd, expected) in CASES.items():
                times[name].append(_time(cmd, expected, env))
    # Imports PyTorch into this process, after the timing (the timed processes start fresh anyway).
    from convnets.deploy.benchmark import environment

    machine = environment("cpu")
    reference = statistics.median(times[REFERENCE])
    print(f"median wall time over {args.rounds} interleaved rounds (fresh processes)")
    print(f"{'case':<30} {'median (s)':>10} {'x import torch':>15}")
    worst = 0.0
    rows = []
    for name, values in times.items():
        ratio = statistics.median(values) / reference
        if name != REFERENCE:
            worst = max(worst, ratio)
        print(f"{name:<30} {statistics.median(values):>10.3f} {ratio:>15.2f}")
        rows.append({"case": name, "median_s": statistics.median(values), "ratio_to_reference": ratio,
                     "seconds_all_rounds": values})
    verdict = "meets" if worst < TARGET else "misses"
    print(f"slowest CLI case: {worst:.2f}x import torch ({verdict} the target < {TARGET}x)")
    results.save(args.json, machine, {"rounds": args.rounds, "reference": REFERENCE, "target_ratio": TARGET,
                                      "slowest_ratio": worst, "rows": rows})
    return 0 if worst < TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
