"""Every shell command in the README and docs/ runs as written: each ```bash fence (found by mktestdocs, the
library made for testing Markdown code blocks) runs in a fresh bash from the repository root, with the environment
`make test`'s set-up made (the CLI is .venv/bin/graphviz-core, nothing activated).

A line whose comment says it starts a server, takes minutes, or needs a GPU, Chromium, Graphviz, another machine
or the package index is left out, with that comment as the reason; everything else must exit 0."""

import os
import re
import subprocess
from pathlib import Path

import pytest
from mktestdocs import grab_code_blocks

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# What a comment on a command line says when the command is not for a test run (docs/architecture.md).
SKIP = re.compile(r"#.*(starts a server|takes minutes|takes a minute|takes about|needs a GPU|needs Chromium|"
                  r"needs Graphviz|on your laptop|needs the package index|rewrites)", re.I)


def blocks():
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for block in grab_code_blocks(text, lang="bash"):
            line = text[: text.index(block)].count("\n") + 1
            yield pytest.param(block, id=f"{page.relative_to(ROOT)}:{line}")


def commands(block: str) -> list[tuple[str, str]]:
    """The block's commands as (text, its shell lines): a line continued with a backslash, or a here-document up to
    its end word, is one command; a here-document's body is data, not shell lines."""
    found, current, shell, heredoc_end = [], [], [], None
    for line in block.splitlines():
        current.append(line)
        if heredoc_end is not None:
            if line.strip() == heredoc_end:
                heredoc_end = None
        else:
            shell.append(line)
            opened = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line)
            heredoc_end = opened.group(1) if opened else None
        if heredoc_end is None and not line.rstrip().endswith("\\"):
            found.append(("\n".join(current), "\n".join(shell)))
            current, shell = [], []
    if current:
        found.append(("\n".join(current), "\n".join(shell)))
    return found


def runnable(block: str) -> tuple[str, list[str]]:
    """The block without the commands a test run leaves out (a comment on any of the command's shell lines marks
    it)."""
    kept, skipped = [], []
    for text, shell in commands(block):
        if SKIP.search(shell):
            skipped.append(shell.splitlines()[0].strip())
        else:
            kept.append(text)
    return "\n".join(kept), skipped


def test_the_skip_rule_keeps_cheap_lines_and_drops_marked_ones():
    script, skipped = runnable("make run     # starts a server; runs until Ctrl-C\n.venv/bin/graphviz-core expr a a=1\n"
                               "make bench \\\n  --only x   # takes minutes\ncat > /tmp/x <<'EOF'\nmake run # takes minutes\nEOF\n")
    assert script == ".venv/bin/graphviz-core expr a a=1\ncat > /tmp/x <<'EOF'\nmake run # takes minutes\nEOF"
    assert skipped == ["make run     # starts a server; runs until Ctrl-C", "make bench \\"]


@pytest.mark.parametrize("block", list(blocks()))
def test_each_documented_command_runs_as_written(block):
    script, skipped = runnable(block)
    if not script.strip():
        pytest.skip("every line here is marked: " + "; ".join(skipped))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRAPHVIZ_CORE_", "VIRTUAL_ENV", "PYTHON"))}
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}\n--- script\n{script}\n--- stderr\n{done.stderr[-3000:]}"
