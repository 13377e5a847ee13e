"""docs/cli.md's sample output of `graph`'s JSON keys is the list the command writes today."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from graphviz_core.cli import main

DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def test_the_sample_key_list_is_what_graph_writes(tmp_path):
    text = DOC.read_text()
    # the block after the sample command that prints sorted(d): its first line is the key list
    block = text[text.index("print(sorted(d))"):]
    shown = ast.literal_eval(re.search(r"```text\n(\[.*?\])\n", block).group(1))
    out = tmp_path / "g.json"
    assert main(["graph", "--preset", "gpt2-tiny", "-o", str(out)]) == 0  # the documented command, as written
    assert shown == sorted(json.loads(out.read_text()))  # it lacked autocast, notes and optimizer
