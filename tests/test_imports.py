"""The house's rules: layers run one way with no cycle, the core imports no Streamlit and pyvis only in the renderer,
no code outside graphviz_core/models branches on a model's name, and importing the core touches neither the UI nor
CUDA."""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "graphviz_core"
# Bottom to top (docs/architecture.md): a module imports only from its own layer or a lower one.
LAYERS = (
    ("units", "fields"),
    ("models",),
    ("config",),
    ("graph",),
    ("capture",),
    ("analysis", "parallel"),
    ("toy",),
    ("export",),
    ("serve",),
    ("ui",),
    ("cli", "cli_record", "cli_debug", "__main__", ""),  # "" is the package root's public API
)
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path = ROOT, type_checking: bool = False) -> set[str]:
    """Every graphviz_core module `path` imports, at module level or inside functions; imports under
    `if TYPE_CHECKING:` (for type hints only, never run) only with `type_checking`."""
    tree = ast.parse(path.read_text())
    skip = set() if type_checking else {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for body in node.body for n in ast.walk(body)}
    found = set()
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "graphviz_core":
                continue
            for alias in node.names:  # `from graphviz_core.capture import engine` imports the module engine
                candidate = f"{base}.{alias.name}"
                found.add(candidate if (root / (candidate.replace(".", "/") + ".py")).exists() else base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "graphviz_core")
    return found


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    return {module_name(p): imports_of(p, type_checking=type_checking) for p in CORE.rglob("*.py")}


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYER_OF[parts[1] if len(parts) > 1 else ""]


def test_every_module_has_a_layer():
    assert sorted(m for m in import_graph() if (m.split(".") + [""])[1] not in LAYER_OF) == []


def test_no_module_imports_one_above_its_layer():
    upward = sorted(f"{a} -> {b}" for a, targets in import_graph().items() for b in targets
                    if b != "graphviz_core" and layer(b) > layer(a))
    assert upward == []


def cycles_in(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself): import cycles."""
    # Tarjan's strongly connected components: a component of more than one module is a cycle.
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycle():
    assert cycles_in(import_graph()) == []


def test_parallel_has_no_import_cycle_even_through_type_checking_imports():
    # A cycle that only type hints close still ties two modules into one: neither can be read or moved alone. parallel/
    # is one file per concern (docs/architecture.md); elsewhere the models' hints name config.ModelConfig, above them.
    graph = {m: {t for t in targets if t.startswith("graphviz_core.parallel.")}
             for m, targets in import_graph(type_checking=True).items() if m.startswith("graphviz_core.parallel.")}
    assert len(graph) >= 12 and cycles_in(graph) == []
    assert cycles_in({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]  # the check finds one


def private_imports(path: Path) -> list[str]:
    """`from graphviz_core.x import _name`: a module reaching into another's private names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("graphviz_core"):
            found += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_private_name_is_imported_across_modules(tmp_path):
    assert [line for p in CORE.rglob("*.py") for line in private_imports(p)] == []
    probe = tmp_path / "probe.py"  # the check itself finds one
    probe.write_text("from graphviz_core.parallel.memory import _FrozenSkipped\n")
    assert private_imports(probe) != []


def test_the_walker_counts_function_level_imports_and_skips_type_checking_ones(tmp_path):
    (tmp_path / "graphviz_core" / "analysis").mkdir(parents=True)
    (tmp_path / "graphviz_core" / "analysis" / "fit.py").write_text("")
    engine = tmp_path / "graphviz_core" / "capture" / "engine.py"
    engine.parent.mkdir()
    engine.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from graphviz_core.ui import state\n"
        "def f():\n    from graphviz_core.analysis import fit\n"
    )
    assert imports_of(engine, tmp_path) == {"graphviz_core.analysis.fit"}
    assert layer("graphviz_core.analysis.fit") > layer("graphviz_core.capture.engine")  # the upward test would fail


def test_streamlit_only_in_ui_and_pyvis_only_in_the_renderer():
    offenders = []
    for path in CORE.rglob("*.py"):
        name, text = module_name(path), path.read_text()
        if re.search(r"^\s*(import|from)\s+streamlit\b", text, re.M) and layer(name) != LAYER_OF["ui"]:
            offenders.append(f"{name} imports streamlit")
        if re.search(r"pyvis", text) and re.search(r"^\s*(import|from)\s+pyvis\b|__import__\(.pyvis", text, re.M) \
                and name not in ("graphviz_core.export.render",) and layer(name) != LAYER_OF["ui"]:
            offenders.append(f"{name} imports pyvis")
    assert offenders == []


def test_no_model_name_branch_outside_the_models_package():
    # A kind of model answers for itself (graphviz_core.models.registry); `config.model == "llama"` elsewhere is the
    # branch that made adding an architecture a dozen edits.
    branch = re.compile(r"""\.model\s*(==|!=|in\b|not in\b)|model\s*(==|!=)\s*["']|model in \(["']""")
    offenders = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in [*CORE.rglob("*.py"), *(ROOT / "pages").glob("*.py")]
        if "models" not in path.relative_to(CORE.parent).parts[1:2] and path.name != "config.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if branch.search(line.split("#")[0]) and not line.strip().startswith(('"', "'", "`"))
    ]
    assert offenders == []


def test_no_function_over_a_hundred_lines():
    long = []
    for path in CORE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 100:
                    long.append(f"{module_name(path)}.{node.name}: {length} lines")
    assert long == []


def test_core_imports_no_streamlit_or_pyvis_and_no_cuda():
    modules = ["graphviz_core", "graphviz_core.config", "graphviz_core.models.registry", "graphviz_core.capture.engine",
               "graphviz_core.graph.categories", "graphviz_core.capture.flop_formulas", "graphviz_core.capture.device",
               "graphviz_core.export.formats", "graphviz_core.cli"]
    code = (
        "import sys\n"
        f"for m in {modules!r}: __import__(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('streamlit', 'pyvis'))\n"
        "import torch\n"
        "print(bad, torch.cuda.is_initialized())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[] False"


def test_importing_the_package_and_its_config_is_light():
    # The public API is imported lazily: `import graphviz_core` and validating a config import no torch.
    code = (
        "import sys, graphviz_core\n"
        "c = graphviz_core.resolve_config('llama-tiny')\n"
        "print(c.model, sorted(m for m in ('torch', 'transformers', 'networkx') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "llama []"


def test_cli_json_capture_imports_no_ui_and_no_dynamo():
    # torch._dynamo costs 1-2 s to import; a TorchDispatchMode subclass imports it on its first aten call
    # unless it opts out, and that import would land inside the timed forward. The one import allowed is torch.optim's
    # own (Optimizer.add_param_group is wrapped in torch._disable_dynamo): the optimizer's step runs after the timed
    # backward (capture.instruments.optimizer), first in the warm-up capture.
    code = (
        "import os, sys, traceback\n"
        "class Watch:\n"
        "    where = None\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch._dynamo' and Watch.where is None:\n"
        "            Watch.where = ''.join(traceback.format_stack())\n"
        "        return None\n"
        "sys.meta_path.insert(0, Watch())\n"
        "from graphviz_core.cli import main\n"
        "assert main(['graph', '--preset', 'gpt2-tiny', '--device', 'cpu', '--format', 'json', '-o', os.devnull]) == 0\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('streamlit', 'pyvis', 'transformers')))\n"
        "print(Watch.where is None or ('torch/optim/' in Watch.where and 'after_backward' in Watch.where))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "True"]


def plan_names() -> set[str]:
    """Every module name a family's parallel plan declares (projections, the stages' parts, each part of a path)."""
    from graphviz_core.config import FAMILIES

    names = set()
    for family in FAMILIES.values():
        plan = family.parallel
        paths = [end for end, _ in plan.tensor]
        if plan.stages is not None:
            paths += [plan.stages.embedding, plan.stages.layers, plan.stages.norm, plan.stages.head]
        names.update(part for path in paths for part in path.split("."))
    return names - {"model", "layers"}  # also plain words of the JSON ("layers" of a stage)


def test_parallel_reads_each_familys_plan_and_guesses_nothing_from_names():
    # No module-name list and no probe of a family's attributes in parallel/: what a model splits, where a pipeline
    # cuts it and whether its attention is a ring are the family's declaration (models.family.ParallelPlan).
    names = plan_names()
    assert {"q_proj", "down_proj", "qkv", "embed_tokens", "lm_head"} <= names  # the check knows what to look for
    found = []
    for path in sorted((CORE / "parallel").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                found.append(f"{path.name}:{node.lineno} {node.value!r}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and node.args and \
                    re.search(r"famil", ast.unparse(node.args[0]), re.I):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert found == []
