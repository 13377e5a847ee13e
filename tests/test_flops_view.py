"""AppTests of the "FLOPs and time" tab on gpt2-tiny (b=2, s=32, h=64, nh=4, d=16, V=512, L=2)."""


from tests.conftest import captured, explorer_tab

B, S, H, NH, D, V, L = 2, 32, 64, 4, 16, 512, 2


def _frame(at, column: str):
    """The first dataframe on the page with this column."""
    return next(d.value for d in at.dataframe if column in d.value.columns)


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
    # every FLOP cell carries its unit
    for frame in at.dataframe:
        for column in ("FLOPs", "forward", "backward"):
            if column in frame.value.columns:
                assert all(v.endswith("FLOP") for v in frame.value[column]), column


def test_flops_tab_times_nodes_on_cpu_and_says_the_overhead_is_subtracted():
    at = explorer_tab("FLOPs and time", 120)
    captions = " ".join(c.value for c in at.caption)
    assert "includes the instrumentation" in captions and "subtracts that overhead" in captions
    top = _frame(at, "achieved")
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

    from graphviz_core.export import CATEGORY_COLOURS

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
