"""Run the benchmarks and rewrite README.md's "Measured speed" table from the rows they print.

Every figure in that table comes from a `README-ROW` line (benchmarks/readme_rows.py) printed in this run; the
table says when, on how many cores and at what load it was measured. `make bench` runs this.

    python benchmarks/update_readme.py [--only bench_capture.py ...] [--dry-run]

With --only, the other benchmarks' rows already in the table are kept (each row names its benchmark).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
from pathlib import Path

from readme_rows import MARK

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- speed-table: start (benchmarks/update_readme.py) -->", "<!-- speed-table: end -->"
# Each benchmark with the options that keep `make bench` to a few minutes per script on a small machine
BENCHMARKS = {
    "bench_capture.py": ["--rounds", "5"],
    "bench_startup.py": ["--rounds", "3"],
    "bench_families.py": ["--repeats", "5"],
    "bench_memory.py": ["--repeats", "3"],
    "bench_compare.py": ["--repeats", "3"],
    "bench_parallel.py": [],
    "bench_render.py": [],
    "bench_fps.py": [],
    "bench_load.py": [],
}


def run(script: str, options: list[str]) -> list[tuple[str, str, str]]:
    """The rows `script` printed (its whole output is echoed as it runs)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}", "GRAPHVIZ_CORE_DEVICE": "cpu"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / script), *options], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, text=True)
    rows = []
    for line in proc.stdout:
        sys.stdout.write(line)
        if line.startswith(MARK):
            what, measured, goal = (part.strip() for part in line.split("|")[1:4])
            rows.append((what, measured, goal))
    if proc.wait() != 0:
        sys.stderr.write(f"{script} exited with {proc.returncode}; its rows are left out\n")
        return []
    return rows


def table(rows: list[tuple[str, str, str]], when: str) -> str:
    lines = [
        START,
        f"Measured {when} on this machine ({os.cpu_count()} CPU cores; load average at the end "
        f"{os.getloadavg()[0]:.1f}) by `make bench`; every figure below is printed by the benchmark named.",
        "",
        "| what | measured | goal |",
        "| --- | --- | --- |",
        *(f"| {w} | {m} | {g} |" for w, m, g in rows),
        END,
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=list(BENCHMARKS))
    parser.add_argument("--dry-run", action="store_true", help="print the table, leave README.md alone")
    args = parser.parse_args()
    rows = []
    for script, options in BENCHMARKS.items():
        if not args.only or script in args.only:
            print(f"== {script} {' '.join(options)}", flush=True)
            rows += [(f"{w} (`{script}`)" if "`" not in w else w, m, g) for w, m, g in run(script, options)]
    readme = (ROOT / "README.md").read_text()
    if START not in readme:
        sys.exit("README.md has no speed-table markers")
    head, rest = readme.split(START, 1)
    if args.only:  # keep the rows of the benchmarks not run now, in the table's order
        ran = set(args.only)
        kept = []
        for line in rest.split(END, 1)[0].splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            script = re.search(r"bench_\w+\.py", cells[0]) if len(cells) == 3 else None
            if script and script.group(0) not in ran:
                kept.append(tuple(cells))
        order = list(BENCHMARKS)
        rank = lambda r: order.index(re.search(r"bench_\w+\.py", r[0]).group(0))  # noqa: E731
        rows = sorted(kept + rows, key=rank)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = table(rows, when)
    print(text)
    if args.dry_run:
        return
    (ROOT / "README.md").write_text(head + text + rest.split(END, 1)[1])


if __name__ == "__main__":
    main()
