"""Run the benchmarks and rewrite the speed table in docs/measurements.md from the rows they print.

Every figure in that table comes from a `README-ROW` line (benchmarks/readme_rows.py) printed in this run; the
table says on which day, on what machine (cores, memory, torch) and at what load it was measured. `make bench` runs
this. The table sits between the two speed-table markers in docs/measurements.md; the rest of that page is left alone.

    python benchmarks/update_readme.py [--only bench_capture.py ...] [--dry-run]

With --only, the other benchmarks' rows already in the table are kept (each row names its benchmark).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

from readme_rows import MARK

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "measurements.md"
START, END = "<!-- speed-table: start (benchmarks/update_readme.py) -->", "<!-- speed-table: end -->"
# Each benchmark with the options that keep `make bench` to a few minutes per script on a small machine
BENCHMARKS = {
    "bench_capture.py": ["--rounds", "5"],
    "bench_peers.py": ["--rounds", "5"],
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
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / script), *options],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
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


def machine() -> str:
    """The machine in a few words: cores, memory, torch's version (`2 CPU cores, 23.5 GiB memory, torch 2.13.0+cpu`)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return f"{os.cpu_count()} CPU cores, {memory / 2**30:.1f} GiB memory, torch {importlib.metadata.version('torch')}"


def table(rows: list[tuple[str, str, str]], header: list[str]) -> str:
    lines = [
        START,
        *header,
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
    parser.add_argument("--dry-run", action="store_true", help="print the table, leave docs/measurements.md alone")
    args = parser.parse_args()
    rows = []
    for script, options in BENCHMARKS.items():
        if not args.only or script in args.only:
            print(f"== {script} {' '.join(options)}", flush=True)
            rows += [(f"{w} (`{script}`)" if "`" not in w else w, m, g) for w, m, g in run(script, options)]
    page = PAGE.read_text()
    if START not in page or END not in page:
        sys.exit(f"{PAGE.relative_to(ROOT)} has no speed-table markers")
    head, rest = page.split(START, 1)
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
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    where = f"on {machine()} (load average at the end {os.getloadavg()[0]:.1f})"
    if args.only:  # the table's own header stays true of the rows kept; a line says which rows are newer, and where
        ran = sorted(args.only)
        old_header = rest.split(END, 1)[0].split("\n\n", 1)[0].strip().splitlines()
        header = [line for line in old_header  # less a line about rows re-measured again now
                  if not (line.startswith("Re-measured on") and set(re.findall(r"bench_\w+\.py", line)) <= set(ran))]
        header.append(f"Re-measured on {when} {where}: the rows of {', '.join(f'`{s}`' for s in ran)}.")
    else:
        header = [f"Measured on {when} by `make bench` {where}; every figure below is printed by the benchmark named."]
    text = table(rows, header)
    print(text)
    if args.dry_run:
        return
    PAGE.write_text(head + text + rest.split(END, 1)[1])


if __name__ == "__main__":
    main()
