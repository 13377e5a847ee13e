"""The core imports without Streamlit or pyvis, and without touching CUDA."""

import subprocess
import sys

CORE_MODULES = ["graphviz_core", "graphviz_core.config", "graphviz_core.models", "graphviz_core.capture",
                "graphviz_core.categories", "graphviz_core.flops", "graphviz_core.device", "graphviz_core.export",
                "graphviz_core.cli"]


def test_core_imports_no_streamlit_or_pyvis():
    code = (
        "import sys\n"
        f"for m in {CORE_MODULES!r}: __import__(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('streamlit', 'pyvis'))\n"
        "import torch\n"
        "print(bad, torch.cuda.is_initialized())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[] False"


def test_cli_json_capture_imports_no_ui_and_no_dynamo():
    # torch._dynamo costs 1-2 s to import; a TorchDispatchMode subclass imports it on its first aten call
    # unless it opts out (issue 13), and that import used to land inside the timed forward (issue 12).
    code = (
        "import os, sys\n"
        "from graphviz_core.cli import main\n"
        "assert main(['graph', '--preset', 'gpt2-tiny', '--device', 'cpu', '--format', 'json', '-o', os.devnull]) == 0\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('streamlit', 'pyvis', 'transformers')"
        " or m.startswith('torch._dynamo')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_no_core_module_imports_the_ui_package():
    # DESIGN.md: the core never imports from graphviz_core/ui (the renderer may). compare_reasons imported
    # ui.format for its byte and FLOP formatting; that now lives in the core's graphviz_core.units.
    import re
    from pathlib import Path

    core = Path(__file__).resolve().parents[1] / "graphviz_core"
    offenders = [
        p.name for p in core.glob("*.py")
        if p.name != "render.py" and re.search(r"^\s*(from|import) graphviz_core\.ui\b", p.read_text(), re.M)
    ]
    assert offenders == []
