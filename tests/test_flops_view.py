"""AppTests of the "FLOPs and time" tab on gpt2-tiny (b=2, s=32, h=64, nh=4, d=16, V=512, L=2)."""

import json

from tests.conftest import captured, explorer_tab, tables

B, S, H, NH, D, V, L = 2, 32, 64, 4, 16, 512, 2


def _frame(at, column: str):
    """The first table on the page with this column: a dataframe, or an st.table (the tables of explanations)."""
    return next(frame for frame in [*(d.value for d in at.dataframe), *tables(at)] if column in frame.columns)


def test_flops_tab_shows_totals_ratios_and_the_rule_of_thumb_with_units():
    at = explorer_tab("FLOPs and time", 120)
    assert not at.exception
    assert "FLOPs and time" in [t.label for t in at.tabs]
    capture = captured("gpt2-tiny")
    metrics = {m.label: m.value for m in at.metric}
    # forward: linear 16_777_216 + fused attention 1_048_576 + elementwise 20_480 = 17_846_272 -> "17.8 MFLOP"
    assert capture.flops.forward == 16_777_216 + 1_048_576 + 20_480
    assert metrics["Forward FLOPs"] == "17.8 MFLOP"
    ratios = _frame(at, "op family").set_index("op family")
    # linear layers: backward dx and dW, two matmuls of the forward's size -> exactly 2x
    assert ratios.loc["linear layers (mm, addmm)", "measured backward / forward"] == "2.00×"
    # fused attention: forward 4*b*nh*s²*d per layer, backward 10*b*nh*s²*d (q·kᵀ recomputed) -> 2.5x
    fused = next(i for i in ratios.index if i.startswith("fused attention"))
    assert ratios.loc[fused, "measured backward / forward"] == "2.50×"
    assert set(ratios["folklore"]) == {"2.00×"}
    rule = _frame(at, "term").set_index("term")
    # 6 · N · tokens = 6 * 134_912 parameters * (2*32) tokens = 51_806_208 -> "51.8 MFLOP"
    assert rule.loc["6·N·tokens", "FLOPs"] == "51.8 MFLOP"
    # attention 12·L·b·s²·h = 12*2*2*1024*64 = 3_145_728 -> "3.1 MFLOP"
    assert rule.loc["+ attention term 12·L·b·s²·h", "FLOPs"] == "3.1 MFLOP"
    # every FLOP cell carries its unit, or says its ops have no FLOP formula
    for frame in [*(d.value for d in at.dataframe), *tables(at)]:
        for column in ("FLOPs", "forward", "backward"):
            if column in frame.columns:
                assert all(v.endswith("FLOP") or v == "not counted" for v in frame[column]), column


def test_flops_tab_times_nodes_on_cpu_and_says_the_overhead_is_subtracted():
    at = explorer_tab("FLOPs and time", 120)
    captions = " ".join(c.value for c in at.caption)
    assert "includes the instrumentation" in captions and "subtracts that overhead" in captions
    top = next(t for t in tables(at) if "achieved" in t.columns)  # the top nodes: an st.table, which wraps at 1280 px
    # the largest backward node of gpt2-tiny is lm_head's MmBackward0: 4*b*s*h*V = 4*2*32*64*512 = 8_388_608
    assert top.iloc[0]["node"].startswith("MmBackward0") and top.iloc[0]["FLOPs"] == "8.4 MFLOP"
    assert any(c.value.startswith("Top 10 nodes by time") for c in at.caption)


def test_highlight_sends_the_node_to_the_graph_search():
    at = explorer_tab("FLOPs and time", 120)
    next(b for b in at.button if b.label == "Highlight in the graph").click().run()
    assert not at.exception
    assert at.text_input(key="view.search").value == "MmBackward0 lm_head"


def test_both_attentions_table_puts_manual_and_fused_side_by_side():
    at = explorer_tab("FLOPs and time", 180)
    at.toggle(key="flops.both_ways").set_value(True).run()
    assert not at.exception
    table = _frame(at, "manual attention").set_index("op")
    # query@key backward with manual attention: 4·b·nh·s²·d = 4*2*4*1024*16 = 524_288 per layer, x2 layers
    assert table.loc[f"{L} layers × query@key", "manual attention"] == "1.0 MFLOP"
    assert table.loc[f"{L} layers × query@key", "textbook"] == "1.0 MFLOP"
    # the fused kernel's one node per layer: 10·b·nh·s²·d = 1_310_720 per layer, x2 = 2_621_440
    assert table.loc[f"{L} layers × attention core, fused", "fused (sdpa), dense count"] == "2.6 MFLOP"


def test_meta_says_time_is_absent():
    at = explorer_tab("FLOPs and time", 120)
    at.selectbox(key="config.device").set_value("meta")
    next(b for b in at.button if b.label == "Run backward pass").click().run()
    assert not at.exception
    assert any("no time and no achieved FLOP/s" in i.value for i in at.info)


def test_chart_units_switch_prefix_at_the_threshold():
    from graphviz_core.ui.format import flops_unit, format_intensity

    assert flops_unit(999) == ("FLOP", 1.0)
    assert flops_unit(1_000) == ("kFLOP", 1e3)  # 1000 FLOP reads as 1 kFLOP, never "1000 FLOP"
    assert flops_unit(8_388_608) == ("MFLOP", 1e6)
    assert flops_unit(2.1e11, "FLOP/s") == ("GFLOP/s", 1e9)
    assert format_intensity(5.6889) == "5.69 FLOP/B" and format_intensity(19.69) == "19.7 FLOP/B"


def test_a_convolutional_network_is_not_held_to_six_n_tokens():
    # resnet-tiny applies each conv weight at every pixel: 6·N·tokens (a per-token, per-parameter rule) read
    # 0.13x there, which says nothing; the page says why it does not apply instead.
    at = explorer_tab("FLOPs and time", preset="resnet-tiny")
    assert not at.exception
    assert {m.label: m.value for m in at.metric}["Measured / rule of thumb"] == "n/a"
    assert any("does not apply to a convolutional network" in c.value for c in at.caption)


def test_categories_whose_ops_have_no_flop_formula_read_not_counted_and_bars_take_the_graph_colours():
    import json

    from graphviz_core.export.formats import CATEGORY_COLOURS

    # resnet-tiny: BatchNorm (normalization) and ReLU (activation) backward have no FLOP formula in torch's
    # flop_counter nor ours, so those categories count 0; conv, matmul, pooling and loss are counted.
    at = explorer_tab("FLOPs and time", preset="resnet-tiny")
    assert not at.exception
    assert any(c.value.startswith("activation, normalization: not counted") for c in at.caption)
    specs = [json.loads(c.proto.spec) for c in at.get("vega_lite_chart")]
    by_category = next(s for s in specs if s.get("encoding", {}).get("y", {}).get("field") == "category")
    scale = by_category["encoding"]["color"]["scale"]
    # one bar per counted category, each in the graph's colour for it (conv blue, matmul dark blue...)
    assert dict(zip(scale["domain"], scale["range"], strict=True)) == {c: CATEGORY_COLOURS[c] for c in scale["domain"]}
    assert set(scale["domain"]) == {"conv", "matmul", "pooling", "loss"}
    assert len(set(scale["range"])) == 4


def test_a_forward_with_no_flop_formula_reads_not_counted_and_the_headline_ratio_leaves_its_backward_out():
    at = explorer_tab("FLOPs and time", 120)
    assert not at.exception
    ratios = _frame(at, "op family").set_index("op family")
    # backward counted by the textbook's per-element formulas, forward ops (gelu, layer_norm, log_softmax) have none:
    # GELU 19 FLOP/element × b·s·4h = 2·32·256 = 16_384 elements × 2 layers = 622_592
    # LayerNorm 11 FLOP/element × b·s·h = 4_096 elements × 5 norms (2 per block + ln_f) = 225_280
    # log-softmax 4 FLOP/element × b·s·V = 64·512 = 32_768 elements = 131_072
    for family, backward in (("GELU", "622.6 kFLOP"), ("LayerNorm", "225.3 kFLOP"), ("log-softmax (loss)", "131.1 kFLOP")):
        assert ratios.loc[family, ["forward", "backward", "measured backward / forward"]].tolist() == [
            "not counted", backward, "n/a"], family
    metrics = {m.label: m.value for m in at.metric}
    # over the families counted both ways: backward linear 2 × 16_777_216 + fused attention 2_621_440 + elementwise
    # 49_152 = 36_225_024, forward 17_846_272: 2.0298 -> "2.03×"; with the 978_944 left out it read 2.08×
    assert metrics["Backward / forward"] == "2.03×"
    note = next(c.value for c in at.caption if c.value.startswith("Backward / forward = "))
    assert note.startswith("Backward / forward = 36.2 MFLOP / 17.8 MFLOP, over the ops counted both ways")
    assert "GELU, LayerNorm and log-softmax (loss)" in note and "978.9 kFLOP" in note and "2.08×" in note


def test_a_node_whose_ops_have_no_flop_formula_reads_not_counted_and_a_view_reads_0_flop():
    at = explorer_tab("FLOPs and time", 120)
    every = _frame_all_nodes(at)
    assert len(every) == captured("gpt2-tiny").summary.nodes  # 101: the expander's table of every node
    flops = dict(zip(every["node"], every["FLOPs"], strict=True))

    def cells(*ops):
        return {v for node, v in flops.items() if node.rpartition(":")[0] in ops}

    # wte's and wpe's lookups (backward: a scatter-add into the table) and NLL's backward have no FLOP formula
    assert cells("EmbeddingBackward0", "NllLossBackward0") == {"not counted"}
    # views and transposes, gradient stores, and the add of token and position embeddings (its backward hands the
    # same gradient to both) do no arithmetic: a true 0
    assert cells("ViewBackward0", "TBackward0", "AccumulateGrad", "AddBackward0") == {"0 FLOP"}


def _frame_all_nodes(at):
    return next(d.value for d in reversed(at.dataframe) if "bytes moved" in d.value.columns)


def test_the_roofline_colours_each_category_as_the_graph_does():
    from graphviz_core.export.formats import CATEGORY_COLOURS

    at = explorer_tab("FLOPs and time", 120)
    assert not at.exception
    specs = [json.loads(c.proto.spec) for c in at.get("vega_lite_chart")]
    roofline = next(s for s in specs if "layer" in s)  # the roof (a line) and the nodes (dots, by category)
    scale = roofline["layer"][1]["encoding"]["color"]["scale"]
    # its own palette drew activation dark blue and matmul pink; the graph draws matmul blue, attention red...
    assert dict(zip(scale["domain"], scale["range"], strict=True)) == {c: CATEGORY_COLOURS[c] for c in scale["domain"]}
    assert {"matmul", "attention"} <= set(scale["domain"])


def test_tables_of_explanations_wrap_and_the_node_tables_fit_their_headers():
    at = explorer_tab("FLOPs and time", 120)
    # st.dataframe cuts a cell at its column's width ("…(embe…"); st.table wraps it, so the whole text shows
    wrapped = {c for t in tables(at) for c in t.columns}
    assert {"op family", "term", "why"} <= wrapped
    assert not [d for d in at.dataframe if "why" in d.value.columns]
    rule = _frame(at, "term")
    assert rule["why"].str.contains("(embedding lookups, biases, norm gains; a tied table counts once)", regex=False).any()
    # "bytes moved" is 11 characters: at about 7 px each plus the header's sort and menu icons it needs ~100 px;
    # auto width fitted the values ("425.9 KiB") and cut it to "bytes move…"
    for frame in (d for d in at.dataframe if "bytes moved" in d.value.columns):
        assert json.loads(frame.proto.columns)["bytes moved"]["width"] >= 100


def test_the_roofline_caption_counts_one_node_in_the_singular():
    from graphviz_core.ui.flops_view import roofline_summary

    assert " 1 node sits above the roof" in roofline_summary(3, 19, 0.08, 1)  # read "1 nodes sit"
    assert " 2 nodes sit above the roof" in roofline_summary(3, 19, 0.08, 2)
    assert roofline_summary(1, 19, 0.08, 0).startswith("1 of these 19 nodes sits left of the ridge")
    assert roofline_summary(3, 19, 0.08, 0).startswith("3 of these 19 nodes sit left of the ridge")
    assert roofline_summary(1, 1, 0.5, 0).startswith("The one node sits left of the ridge")
    assert "above the roof" not in roofline_summary(3, 19, 0.08, 0)
