"""The README's speed table is made of the lines benchmarks print with row(); update_readme.py collects them."""

MARK = "README-ROW"


def row(what: str, measured: str, goal: str) -> None:
    """One row of the README's "Measured speed" table, printed as `README-ROW | what | measured | goal`."""
    print(f"{MARK} | {what} | {measured} | {goal}", flush=True)
