"""Every benchmark in this directory, one after another: ``python bench/run_all.py [--quick]``.

Runs each ``bench/bench_*.py`` script in name order in its own Python process (so one script's
servers, threads and memory never colour the next one's figures) and prints its output as it
comes. ``--quick`` is passed on to the scripts that take it; the others run as they are. ``-k
WORD`` runs only the scripts whose name contains WORD. Figures are printed, never asserted; the
exit status is 1 when a script failed, so a broken benchmark does not go unnoticed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent


def takes_quick(script: Path) -> bool:
    """Whether the script understands ``--quick`` (it says so in its own argument parser)."""
    return '"--quick"' in script.read_text(encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs, where a script has them")
    parser.add_argument("-k", dest="keyword", default="", help="only scripts whose name has this")
    args = parser.parse_args()
    scripts = sorted(s for s in BENCH_DIR.glob("bench_*.py") if args.keyword in s.stem)
    failed: list[str] = []
    for script in scripts:
        command = [sys.executable, str(script)]
        if args.quick and takes_quick(script):
            command.append("--quick")
        print(f"\n=== {script.name} {' '.join(command[2:])}".rstrip(), flush=True)
        started = time.perf_counter()
        result = subprocess.run(command, cwd=BENCH_DIR.parent, check=False)
        seconds = time.perf_counter() - started
        if result.returncode != 0:
            failed.append(script.name)
            print(f"=== {script.name} failed with exit status {result.returncode}", flush=True)
        else:
            print(f"=== {script.name} done in {seconds:.0f} s", flush=True)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
