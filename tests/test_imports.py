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
