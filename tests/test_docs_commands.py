"""Every shell command in the README and docs/ runs as written: each ```bash fence (found by mktestdocs, the
library made for testing Markdown code blocks) runs in a fresh bash from the repository root, with the environment
`make test`'s set-up made (the CLI is .venv/bin/graphviz-core, nothing activated).

A line whose comment says it starts a server, takes minutes, or needs a GPU, Chromium, Graphviz, another machine
or the package index is left out, with that comment as the reason; everything else must exit 0.

Two rules keep this test from paying twice for the same thing: a command that runs this project's own tests
(`python -m pytest tests/...`) only collects them (`--collect-only`: what it names must exist and be selected; the
suite runs those tests itself), and a command already run, exactly as written, by an earlier block whose output
files no command has rewritten since is not run again (its outputs are still there for the lines that read them).
The blocks run in one pytest-xdist worker (group "docs"), in page order: they share files under /tmp.

They run in a stand-in of the repository root (every entry a link to the real one) whose .venv/bin/graphviz-core hands
the command to one warm process that has imported the package, torch and transformers' model modules once
(tests/docs_zygote.py): the command runs as written, in its own forked process, without the 2-4 s of imports each
fresh process would pay first."""

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


OWN_TESTS = re.compile(r"^(\S*python\S* -m pytest)( .*\btests/)", re.M)  # a command running this project's tests
TMP_PATH = re.compile(r"/tmp/[\w.-]+")  # the files the documented commands share
OUTPUT = re.compile(r"(?:-o|>)\s*(/tmp/[\w.-]+)")  # where a command writes: `-o FILE` or a redirection


class Runs:
    """What the blocks run so far wrote: each /tmp file's version (how many commands wrote it), and for each command
    run, the versions of the files it names as it left them."""

    def __init__(self) -> None:
        self.version: dict[str, int] = {}
        self.left: dict[str, dict[str, int]] = {}

    def files(self, shell: str) -> dict[str, int]:
        return {path: self.version.get(path, 0) for path in TMP_PATH.findall(shell)}

    def ran(self, script: str) -> None:
        for text, shell in commands(script):
            for path in OUTPUT.findall(shell):
                self.version[path] = self.version.get(path, 0) + 1
            self.left[text.strip()] = self.files(shell)

    def not_run_again(self, script: str) -> tuple[str, list[str]]:
        """The script without the commands run before exactly as written that write a file, when no file they name
        (read or written) has been written since; and those commands."""
        kept, again = [], []
        for text, shell in commands(script):
            before = self.left.get(text.strip())
            if OUTPUT.search(shell) and "<<" not in shell and before is not None and before == self.files(shell):
                again.append(text.strip())
            else:
                kept.append(text)
        return "\n".join(kept), again


RUNS = Runs()


def collected_only(script: str) -> str:
    """`python -m pytest ... tests/...` as `--collect-only`: the suite runs those tests itself."""
    return OWN_TESTS.sub(r"\1 --collect-only\2", script)


def test_a_command_run_again_with_its_files_untouched_is_left_out():
    cmd = ".venv/bin/graphviz-core graph --model-file /tmp/net.py:make -o /tmp/g.json"
    runs = Runs()
    assert runs.not_run_again(cmd) == (cmd, [])  # never run
    runs.ran(f"cat > /tmp/net.py <<'EOF'\nx\nEOF\n{cmd}")
    assert runs.not_run_again(f"{cmd}\ncat /tmp/g.json") == ("cat /tmp/g.json", [cmd])
    runs.ran("cat > /tmp/net.py <<'EOF'\ny\nEOF")  # its input rewritten: it runs again
    assert runs.not_run_again(cmd) == (cmd, [])
    runs.ran(cmd)
    runs.ran(".venv/bin/graphviz-core graph --layers 1 -o /tmp/g.json")  # its output rewritten: it runs again
    assert runs.not_run_again(cmd) == (cmd, [])
    assert collected_only(".venv/bin/python -m pytest -q tests/test_families.py -k x") == (
        ".venv/bin/python -m pytest --collect-only -q tests/test_families.py -k x")


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("GRAPHVIZ_CORE_", "VIRTUAL_ENV", "PYTHON"))}


def _linked(source: Path, target: Path, replaced: dict[str, object]) -> None:
    """`target` as a directory of links to `source`'s entries, except those in `replaced` (a name -> the text of an
    executable to write there, or a dict: a directory made the same way one level down)."""
    target.mkdir()
    for entry in source.iterdir():
        if entry.name not in replaced:
            (target / entry.name).symlink_to(entry)
    for name, what in replaced.items():
        if isinstance(what, dict):
            _linked(source / name, target / name, what)
        else:
            (target / name).write_text(what)
            (target / name).chmod(0o755)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The directory the commands run in: the repository, with .venv/bin/graphviz-core handing each command to a warm
    process (tests/docs_zygote.py). GRAPHVIZ_DOCS_ZYGOTE=0 runs them in the repository itself, each in a fresh
    process."""
    if os.environ.get("GRAPHVIZ_DOCS_ZYGOTE") == "0":
        yield ROOT, {}
        return
    from tests.docs_zygote import shim, start

    place = tmp_path_factory.mktemp("docs-root")
    sock = str(place / "zygote.sock")
    warm = start(sock, _environment())
    try:
        _linked(ROOT, place / "repo", {".venv": {"bin": {"graphviz-core": shim(sock)}}})
        yield place / "repo", {"GRAPHVIZ_DOCS_ZYGOTE": sock}
    finally:
        warm.terminate()
        warm.wait(timeout=30)


@pytest.mark.parametrize("block", list(blocks()))
def test_each_documented_command_runs_as_written(block, root):
    script, skipped = runnable(block)
    script, again = RUNS.not_run_again(collected_only(script))
    if not script.strip():
        pytest.skip("every line here is marked or ran before: " + "; ".join(skipped + again))
    where, extra = root
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=where, env={**_environment(), **extra},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}\n--- script\n{script}\n--- stderr\n{done.stderr[-3000:]}"
    RUNS.ran(script)
