"""The speed table in docs/measurements.md is made of the lines benchmarks print with row(); update_readme.py collects
them (the mark keeps its old name: every benchmark prints it)."""

MARK = "README-ROW"


def row(what: str, measured: str, goal: str) -> None:
    """One row of the speed table in docs/measurements.md, printed as `README-ROW | what | measured | goal`."""
    print(f"{MARK} | {what} | {measured} | {goal}", flush=True)
