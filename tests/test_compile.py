"""--compile: the step under torch.compile, each CompiledFunctionBackward opened (graphviz_core.capture.compiled).

The independent counts here compile the same model with torch's own APIs (torch.compile, AOTAutograd, inductor's
partition_fn) and count what autograd saves with saved_tensors_hooks, or ask torch._dynamo.explain for the breaks.
"""

from __future__ import annotations

import functools
import json
from collections import Counter

import pytest
import torch

from graphviz_core.capture.engine import capture_backward
from graphviz_core.cli import main
from graphviz_core.config import resolve_config
from graphviz_core.models.registry import build_model, compute_loss, make_batch

BREAK_NET = '''\
import torch
from torch import nn


class TwoHalves(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.second = nn.Linear(32, 8)

    def forward(self, x):
        h = nn.functional.gelu(self.first(x))
        torch._dynamo.graph_break()
        return nn.functional.gelu(self.second(h))


def make():
    torch.manual_seed(0)
    return TwoHalves(), torch.randn(4, 16), lambda out: out.pow(2).mean()
'''


@functools.lru_cache(maxsize=2)
def compiled_json(preset: str) -> dict:
    """`graph --preset PRESET --compile --format json`, as a user gets it."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "compiled.json")
        assert main(["graph", "--preset", preset, "--device", "cpu", "--compile", "-o", out]) == 0
        with open(out) as f:
            return json.load(f)


def gpt2_tiny_json() -> dict:
    return compiled_json("gpt2-tiny")


def compiled_keeping_graphs(model: torch.nn.Module) -> tuple[torch.nn.Module, dict]:
    """`model` under torch.compile with torch's own APIs alone: AOTAutograd with inductor's partitioner and
    decompositions, and compilers that keep the forward and backward FX graphs in the dict returned ("fw", "bw"),
    filled once a step has compiled them."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table

    graphs = {}

    def keep(side):
        def compiler(gm, example_inputs):
            graphs[side] = gm
            return make_boxed_func(gm.forward)

        return compiler

    backend = aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"), partition_fn=partition_fn,
                           decompositions=select_decomp_table())
    return torch.compile(model, backend=backend), graphs


@functools.lru_cache(maxsize=1)
def independent_gpt2_tiny() -> dict:
    """gpt2-tiny compiled here with torch's APIs alone: AOTAutograd with inductor's partitioner and decompositions,
    compilers that keep the FX graphs; then one step's saves counted by saved_tensors_hooks on the compiled node."""
    config = resolve_config("gpt2-tiny", device="cpu")
    model, batch = build_model(config), make_batch(config, "cpu")
    torch._dynamo.reset()
    try:
        compiled, graphs = compiled_keeping_graphs(model)
        compute_loss(config, compiled(batch.inputs), batch.targets).backward()  # compiles forward and backward
        packed = []

        def pack(t):
            packed.append(t)
            return len(packed) - 1

        unpacked = []

        def unpack(i):
            unpacked.append(i)
            return packed[i]

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            loss = compute_loss(config, compiled(batch.inputs), batch.targets)
        node = loss.grad_fn
        stack, seen = [node], set()
        while stack:  # find the compiled node by a next_functions walk
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if node.name() == "CompiledFunctionBackward":
                break
            stack.extend(n for n, _ in node.next_functions)
        node.saved_tensors  # noqa: B018 - reading the field unpacks each of this node's saves once
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages = {}
        for i in unpacked:
            storage = packed[i].untyped_storage()
            if storage.data_ptr() not in params:
                storages[storage.data_ptr()] = storage.nbytes()
        layer_norms = sum(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
        return {"hook_bytes": sum(storages.values()), "saves": len(unpacked),
                "bw_nodes": [n.name for n in graphs["bw"].graph.nodes], "layer_norms": layer_norms}
    finally:
        torch._dynamo.reset()


def compiled_nodes(out: dict) -> list[dict]:
    return [n for n in out["graph"]["nodes"] if n["op"] == "CompiledFunctionBackward"]


def test_gpt2_tiny_compiled_saved_bytes_are_a_hook_count_beside_eager():
    out, mine = gpt2_tiny_json(), independent_gpt2_tiny()
    (node,) = compiled_nodes(out)  # no graph break in gpt2-tiny: one region, one compiled node
    assert out["compile"]["graphs"] == 1 and out["compile"]["graph_breaks"] == 0
    # The compiled node's saved bytes: the capture's hook count, the opened FX graph's own sum over its saved
    # placeholders (storages counted once, parameters apart), and this test's saved_tensors_hooks count agree.
    assert node["saved_bytes"] == node["compiled"]["saved_bytes"] == mine["hook_bytes"] > 0
    assert node["compiled"]["saved_at_run"] == len(node["compiled"]["saved"]) == mine["saves"]
    assert out["compile"]["compiled_saved_bytes"] == node["saved_bytes"]
    compiled, eager = out["memory"]["saved_bytes"], out["compile"]["eager_saved_bytes"]
    eager_capture = capture_backward(resolve_config("gpt2-tiny", device="cpu"), instruments={"saved"})
    assert eager == eager_capture.memory.saved_bytes
    # Why compiled <= eager. Eager LayerNorm saves x, its mean and 1/std; the decomposed norm inductor partitions
    # saves x-hat and 1/std (x-hat replaces x, same size), so the mean, a (b, s, 1) fp32 tensor, is not kept:
    # 5 LayerNorms (2 layers x 2 + the final one) x 2*32*1*4 B = 1,280 B less.
    assert mine["layer_norms"] == 5
    assert eager - compiled == mine["layer_norms"] * 2 * 32 * 1 * 4 == 1280
    stats = Counter(tuple(s["shape"]) for s in node["compiled"]["saved"])
    eager_stats = Counter(e["shape"] for e in (vars(x) for x in eager_capture.save_order) if e["counted"])
    assert stats[(2, 32, 1)] == 5 and eager_stats[(2, 32, 1)] == 10  # 1/std per norm vs mean and 1/std per norm
    # And GELU costs no more than eager: min-cut recomputes its tanh approximation's pointwise ops in backward from
    # the saved c_fc output instead of saving them (one tanh per layer in the recompute list).
    recomputed = Counter(op["op"] for op in node["compiled"]["recomputed"])
    assert recomputed["tanh"] == 2  # 2 layers, one GELU each
    assert not {op["name"] for op in node["compiled"]["recomputed"]} & {s["name"] for s in node["compiled"]["saved"]}


def test_the_opened_backward_lists_its_fx_nodes():
    out, mine = gpt2_tiny_json(), independent_gpt2_tiny()
    (node,) = compiled_nodes(out)
    opened = node["compiled"]
    # the FX backward graph this test compiled itself, node for node
    assert opened["backward_nodes"] == len(opened["nodes"]) == len(mine["bw_nodes"])
    assert [n["name"] for n in opened["nodes"]] == mine["bw_nodes"]
    roles = Counter(n["role"] for n in opened["nodes"])
    assert roles["saved"] == len(opened["saved"]) and roles["recomputed"] == len(opened["recomputed"])
    assert roles["tangent"] == 1 and roles["output"] == 1  # one incoming gradient (the logits'), one output node
    names = {n["name"] for n in opened["nodes"]}
    assert all(a in names and b in names for a, b in opened["edges"])
    # every saved tensor and recomputed op has its shape (multi-output kernels such as the attention backward
    # return tuples, which getitem nodes unpack with shapes)
    shaped = {n["name"] for n in opened["nodes"] if n["shape"] is not None}
    assert {n["name"] for n in opened["nodes"] if n["role"] in ("saved", "recomputed")} <= shaped


def test_the_run_says_which_partitioner_and_that_no_code_was_generated():
    out = gpt2_tiny_json()
    assert "min_cut_rematerialization_partition" in out["compile"]["partitioner"]
    assert "inductor" in out["compile"]["partitioner"]
    assert out["compile"]["code_generated"] is False and "no code generated" in out["compile"]["note"]
    assert out["compile"]["compile_s"] > 0 and out["compile"]["recompiled_during_step"] == 0
    assert out["config"]["compile"] is True
    assert out["summary"]["by_category"]["compiled"] == 1


def test_a_graph_break_gives_two_compiled_nodes_and_its_reason(tmp_path):
    path = tmp_path / "break_net.py"
    path.write_text(BREAK_NET)
    out_file = tmp_path / "out.json"
    assert main(["graph", "--model-file", f"{path}:make", "--compile", "-o", str(out_file)]) == 0
    out = json.loads(out_file.read_text())
    # independently: dynamo's own explain on the same module
    import importlib.util

    spec = importlib.util.spec_from_file_location("break_net", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model, x, _ = module.make()
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_count == 2 and explained.graph_break_count == 1
    assert len(compiled_nodes(out)) == explained.graph_count == out["compile"]["graphs"]
    assert out["compile"]["graph_breaks"] == explained.graph_break_count
    (reason,) = out["compile"]["break_reasons"]
    line = BREAK_NET.splitlines().index("        torch._dynamo.graph_break()") + 1
    assert reason["where"] == f"break_net.py:{line} in forward"
    assert "graph_break()" in reason["reason"] and "graph_break()" in explained.break_reasons[0].reason
    first, second = sorted(compiled_nodes(out), key=lambda n: n["compiled"]["region"])
    assert first["compiled"]["graph_break_after"] == reason["reason"] and second["compiled"]["graph_break_after"] == ""
    # Region 1 saves x (4x16) and the first Linear's output (4x32), from which backward recomputes GELU; region 2
    # saves h (4x32) and the second Linear's output (4x8), and the second weight (a parameter, not counted):
    # (4*16 + 4*32) * 4 = 768 B and (4*32 + 4*8) * 4 = 640 B.
    assert first["compiled"]["saved_bytes"] == first["saved_bytes"] == 768
    assert second["compiled"]["saved_bytes"] == second["saved_bytes"] == 640
    assert {op["op"] for op in first["compiled"]["recomputed"]} >= {"erf"}  # GELU's erf form, recomputed
    assert out["config"]["compile"] is True


@pytest.mark.parametrize("flags, words", [
    (["--device", "meta"], "--device cpu or cuda"),
    (["--checkpoint", "full"], "--checkpoint none"),
])
def test_what_compile_does_not_capture_is_refused_with_the_fix(flags, words, capsys):
    assert main(["graph", "--preset", "gpt2-tiny", "--compile", *flags, "-o", "/dev/null"]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_the_explorer_opens_the_compiled_node_below_its_figures():
    from graphviz_core.units import format_bytes
    from tests.conftest import explorer_tab, plain

    at = explorer_tab("Graph", timeout=300, preset="gpt2-tiny", compile="1")
    assert not at.exception
    (expander,) = [e for e in at.expander if e.label.startswith("Compiled backward")]
    assert expander.label.startswith("Compiled backward: 1 compiled node, 0 graph breaks, compiled in ")
    out = gpt2_tiny_json()  # the same config from the CLI: its figures, byte for byte
    text = " ".join(plain(m.value) for m in at.markdown)
    assert (f"**{format_bytes(out['memory']['saved_bytes'])}** compiled, "
            f"**{format_bytes(out['compile']['eager_saved_bytes'])}** eager") in text
    (node,) = compiled_nodes(out)
    assert f"its backward FX graph has **{node['compiled']['backward_nodes']} nodes**" in text
    assert any("torch.compile" in plain(c.value) for c in at.caption)  # the run's config line says so
    assert [c.label for c in at.checkbox if c.label == "torch.compile"] and at.checkbox(key="config.compile").value


def _two_halves():
    namespace: dict = {}
    exec(compile(BREAK_NET, "break_net.py", "exec"), namespace)  # noqa: S102 - the test's own module text
    return namespace["make"]()


def test_compiled_captures_in_threads_beside_eager_ones_each_get_their_own_regions():
    # A server runs captures in threads: a compiled one runs alone (graphviz_core.capture.step_gate: dynamo's caches,
    # counters and its "a dispatch mode is active" guard flag are the process's), the eager one before or after it.
    # Each compiled capture sees its 2 regions and their bytes, and its step runs the code its compile step made.
    from concurrent.futures import ThreadPoolExecutor

    from graphviz_core.capture.own_module import capture_module

    def compiled_capture():
        model, x, loss = _two_halves()
        return capture_module(model, x, loss, name="two halves", compile=True)

    with ThreadPoolExecutor(3) as pool:
        runs = [pool.submit(compiled_capture), pool.submit(compiled_capture),
                pool.submit(capture_backward, resolve_config("gpt2-tiny", device="cpu"))]
        first, second, eager = (run.result() for run in runs)
    with ThreadPoolExecutor(2) as pool:  # two compiled captures alone: each runs the code its compile step made
        alone = [run.result() for run in [pool.submit(compiled_capture), pool.submit(compiled_capture)]]
    assert [c.compiled["recompiled_during_step"] for c in alone] == [0, 0]
    for capture in (first, second):
        assert capture.summary.by_op["CompiledFunctionBackward"] == 2
        assert capture.compiled["graphs"] == 2 and len(capture.compiled["regions"]) == 2
        assert [r["region"] for r in capture.compiled["regions"]] == [0, 1]
        assert capture.compiled["recompiled_during_step"] == 0 and "compiled again" not in capture.compiled["note"]
        assert capture.compiled["compiled_saved_bytes"] == 768 + 640  # the two regions' bytes derived above
    assert "CompiledFunctionBackward" not in eager.summary.by_op and eager.compiled is None


def test_a_dispatch_mode_flag_left_set_by_other_threads_does_not_make_the_step_compile_again():
    # Two threads' dispatch modes left out of order (A enters, B enters, A leaves, B leaves) leave torch's
    # process-wide "inside a mode without ignore_compile_internals" flag set: B restores the True it found. A
    # compiled step under that flag is compiled again mid-step; the capture clears it while it runs alone.
    import threading

    from torch.utils import _python_dispatch as dispatch
    from torch.utils._python_dispatch import TorchDispatchMode

    from graphviz_core.capture.own_module import capture_module

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def thread_a():
        with Passing():
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def thread_b():
        a_in.wait(5)
        with Passing():
            b_in.set()
            a_out.wait(5)

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert dispatch._is_in_any_mode_without_ignore_compile_internals  # the flag is stuck, no mode active
    model, x, loss = _two_halves()
    capture = capture_module(model, x, loss, name="two halves", compile=True)
    assert capture.compiled["recompiled_during_step"] == 0
    assert capture.summary.by_op["CompiledFunctionBackward"] == 2  # the graph break's two regions


def llama_tiny_json() -> dict:
    return compiled_json("llama-tiny")


def test_a_compiled_steps_forward_flops_are_filed_under_the_modules_that_ran_them():
    """Module hooks do not run inside compiled code; the FX graph's nn_module_stack names each op's module. Before,
    every forward FLOP of a compiled llama sat under "" ("(loss and glue)"): forward_by_module was {'': 14,825,056}."""
    out = llama_tiny_json()
    by_module = out["flops"]["forward_by_module"]
    assert "" not in by_module and sum(by_module.values()) == out["flops"]["forward"]
    eager = capture_backward(resolve_config("llama-tiny", device="cpu"), instruments={"flops"}).flops.forward_by_module
    # Each module eager counts, compiled counts the same: the same matmuls, norms and rotary ops, module by module.
    assert {m: by_module.get(m) for m in eager} == eager
    # The one addition: inductor decomposes SiLU into x / (1 + exp(-x)), whose add and div count one FLOP per
    # element each (eager's fused silu has no formula): 2 x batch 2 x seq 32 x intermediate 128 = 16,384 per layer.
    extra = {m: f for m, f in by_module.items() if m not in eager}
    assert extra == {f"model.layers.{i}.mlp.act_fn": 2 * 2 * 32 * 128 for i in range(2)}
    assert out["flops"]["forward_by_module_op"]["model.layers.0.mlp.act_fn"] == {"aten.add": 2 * 32 * 128, "aten.div": 2 * 32 * 128}


def test_a_compiled_nodes_saved_bytes_and_backward_flops_split_by_module():
    out = llama_tiny_json()
    (node,) = compiled_nodes(out)
    rows = node["compiled"]["by_module"]
    # the split adds up to the node's own figures
    assert sum(r["saved_bytes"] for r in rows) == node["saved_bytes"] > 0
    assert sum(r["flops"] for r in rows) == node["flops"] > 0
    # in the order the forward ran the modules: the embedding, each layer in turn, the final norm, the head
    modules = [r["module"] for r in rows]
    assert modules.index("model.embed_tokens") < modules.index("model.layers.0.self_attn.q_proj") \
        < modules.index("model.layers.1.self_attn.q_proj") < modules.index("model.norm") < modules.index("lm_head")
    row = {r["module"]: r for r in rows}
    # the head's backward: dx = dy·Wᵀ and dW = dyᵀ·x, two matmuls of b·s = 64 rows, hidden 64, vocab 512:
    # 2 x (2·64·64·512) = 8,388,608; it saves its input x (64 x 64 float32 = 16,384 B)
    assert row["lm_head"]["flops"] == 2 * 2 * 64 * 64 * 512 and row["lm_head"]["saved_bytes"] == 64 * 64 * 4
    # what stays outside every module: the loss's glue, a few hundred bytes, not the whole model any more
    assert row[""]["saved_bytes"] < 1024


def test_compare_eager_vs_compiled_files_each_layer_on_both_sides_in_forward_order(tmp_path):
    out = tmp_path / "compare.json"
    assert main(["compare", "--preset", "llama-tiny", "--device", "cpu", "-o", str(out), "--vs", "--compile"]) == 0
    per_layer = json.loads(out.read_text())["per_layer"]
    layers = [p["layer"] for p in per_layer]
    order = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head", "(loss and glue)"]
    assert [name for name in layers if name in order] == order  # before: lm_head first, the loss last
    row = {p["layer"]: p for p in per_layer}
    for name in ("model.layers.0", "model.layers.1", "lm_head"):
        assert row[name]["b_saved_bytes"] > 0 and row[name]["b_flop"] > 0  # before: 0, all under the loss and glue
    # the head does the same work either way: forward x·Wᵀ (2·64·64·512) + its two backward matmuls
    assert row["lm_head"]["a_flop"] == row["lm_head"]["b_flop"] == 3 * 2 * 64 * 64 * 512
    glue = row["(loss and glue)"]
    assert glue["b_saved_bytes"] - glue["a_saved_bytes"] < 1024 and glue["b_flop"] < 2 * glue["a_flop"]


def test_a_compiled_nodes_saved_tensors_are_freed_once_it_has_run():
    """Running the partitioned graphs node by node (to name each node's module) must not keep anything alive: the
    interpreter's last environment and argument iterator held the region's saved tensors and its returned gradients
    after the node ran, and the compiled llama-tiny step's peak read 2,400,264 B instead of 1,858,376 B."""
    timeline = llama_tiny_json()["memory"]["timeline"]
    kinds, steps = timeline["kinds"], timeline["steps"]
    saved = kinds.index("saved activations")
    (at,) = [i for i, s in enumerate(steps) if s["label"].startswith("CompiledFunctionBackward")]
    # while it runs it holds what its forward saved (the timeline counts whole storages: a little more than the
    # node's own figure); the next step (the first AccumulateGrad) holds what the few nodes outside the region
    # still keep, a KiB at most (before the fix: the whole region's, 463,104 B)
    assert steps[at]["bytes"][saved] >= compiled_nodes(llama_tiny_json())[0]["saved_bytes"]
    assert steps[at + 1]["bytes"][saved] <= 1024
    # the peak is the compiled node's moment: parameters + every gradient + its saved tensors + temporaries
    assert timeline["peak_step"] == at and timeline["peak_bytes"] == sum(steps[at]["bytes"])


def test_compare_says_why_the_compiled_peak_rises_while_it_saves_less(tmp_path):
    out = tmp_path / "compare.json"
    assert main(["compare", "--preset", "llama-tiny", "--device", "cpu", "-o", str(out), "--vs", "--compile"]) == 0
    result = json.loads(out.read_text())
    head = {h["name"]: h for h in result["headline"]}
    assert head["Saved for backward"]["delta"] < 0 < head["Peak memory"]["delta"]  # the pair the sentence is for
    (sentence,) = [e for e in result["explanations"] if e.startswith("compile")]
    a, b = head["Peak memory"]["a"], head["Peak memory"]["b"]
    assert f"The peak rises nonetheless ({a:,} B eager → {b:,} B compiled)" in sentence
    # the figures it names are the compiled step's own at its peak (the compiled node's moment): the saved tensors
    # the timeline holds there, and every parameter's gradient (all 21 AccumulateGrad's, 558,336 B = 4 B x 139,584)
    timeline = llama_tiny_json()["memory"]["timeline"]
    held = timeline["steps"][timeline["peak_step"]]["bytes"][timeline["kinds"].index("saved activations")]
    assert f"its saved tensors ({held:,} B)" in sentence
    assert llama_tiny_json()["memory"]["gradient_bytes"] == 4 * 139_584
    assert f"the gradients ({llama_tiny_json()['memory']['gradient_bytes']:,} B)" in sentence


def test_the_fx_view_opens_at_the_incoming_gradient_with_each_saved_tensor_above_its_reader():
    """The compiled backward's FX view opened on a top row of every saved tensor (thousands of px wide, their edges
    running off the pane), and its legend had no entry for them (black boxes under `other`)."""
    import re

    from graphviz_core.export.render import node_widths, render_html
    from graphviz_core.graph.compiled import LEGEND, fx_backward_graph, fx_layout, start_node

    opened = compiled_nodes(gpt2_tiny_json())[0]["compiled"]
    graph = fx_backward_graph(opened)
    saved = [n for n, d in graph.nodes(data=True) if d["role"] == "saved"]
    assert saved and {graph.nodes[n]["category"] for n in saved} == {"saved_tensor"}
    layout = fx_layout(graph, node_widths(graph))
    depth = {n: d for d, layer in enumerate(layout.layers) for n in layer}
    # each saved tensor one layer above the first op that reads it (a reader in the first two layers: at the top)
    for node in saved:
        first = min(depth[r] for r in graph.successors(node))
        assert depth[node] == max(first - 1, 0), node
    assert len(layout.layers[0]) < len(saved) / 2  # no longer one row of them all
    assert start_node(graph) == "tangents_1"
    html = render_html(graph, legend_labels=LEGEND, layout=layout, start=start_node(graph))
    assert '"loss":"tangents_1"' in html  # the first view's anchor: where backward starts
    legend = re.findall(r'<li><span class="swatch"[^>]*></span>([^<]+)</li>', html)
    assert {"saved by the forward", "incoming gradient", "returned gradients"} <= set(legend), legend
