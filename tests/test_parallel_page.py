"""AppTest of the "Beyond one GPU" page: the default FSDP-over-8 simulation renders, bad layouts are refused."""

from pathlib import Path

import torch.distributed as dist
from streamlit.testing.v1 import AppTest

from graphviz_core.ui.format import format_bytes
from tests.conftest import tables

PAGE = str(Path(__file__).resolve().parent.parent / "pages" / "parallel.py")


def test_default_page_shows_an_eighth_of_the_parameters_per_rank():
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    assert not at.exception
    # gpt2-tiny has 134912 float32 parameters = 539648 bytes; FSDP over 8 ranks: 539648 / 8 = 67456 bytes.
    assert at.metric[0].label == "Parameters per rank"
    assert at.metric[0].value == format_bytes(67_456) == "65.9 KiB"
    # AdamW: 2 * 67456 + a 4-byte step for each of 28 tensors = 135024 bytes.
    assert at.metric[2].value == format_bytes(135_024)
    assert not dist.is_initialized()  # the fake process group was torn down


def test_a_bad_layout_is_an_error_and_the_last_result_stays():
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    at.selectbox(key="parallel.strategy").set_value("fsdp+tp")
    at.number_input(key="parallel.world_size").set_value(6)
    at.number_input(key="parallel.tp").set_value(4)
    next(b for b in at.button if b.label == "Simulate ranks").click().run()
    assert not at.exception
    assert any("world size 6 is not divisible by TP degree 4" in e.value for e in at.error)
    assert at.metric[0].value == "65.9 KiB"


def test_tensor_parallel_lists_backward_all_reduces_from_autograd_nodes():
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    at.selectbox(key="parallel.strategy").set_value("tp")
    at.number_input(key="parallel.world_size").set_value(2)
    at.number_input(key="parallel.tp").set_value(2)
    next(b for b in at.button if b.label == "Simulate ranks").click().run()
    assert not at.exception
    backward = tables(at)[-2]  # the backward table (forward/optimizer's is last), an st.table: it wraps at 1280 px
    # 2 layers x (attention + MLP): one all-reduce of the (2, 32, 64) float32 input gradient each = 16 KiB.
    assert list(backward["Collective"]) == ["all-reduce"] * 4
    assert set(backward["Buffer"]) == {"16.0 KiB"}
    assert set(backward["Autograd node (communication)"]) == {"_FromTorchTensorBackward"}


def test_the_per_rank_chart_reads_in_gib_once_a_rank_holds_gibibytes():
    import json

    # GPT-2 shape at width 1024 with a 65,536-token vocabulary, one layer, under DDP over 2: every rank holds all of it.
    # Embeddings 65536 x 1024 + positions 32 x 1024 + one block 12 x 1024^2 + norms: ~80M float32 parameters, 4 bytes
    # each for the weights, the gradients and AdamW's two moments = 16 bytes x 80M: about 1.2 GiB, and the peak ~2 GiB
    at = AppTest.from_file(PAGE, default_timeout=300)
    at.query_params.update({"model": "gpt2", "hidden": "1024", "heads": "16", "layers": "1", "vocab": "65536",
                            "batch": "1", "strategy": "ddp", "world_size": "2"})
    at.run()
    assert not at.exception
    peak = next(m.value for m in at.metric if m.label == "Peak memory per rank")
    assert peak.endswith("GiB"), peak
    specs = [json.loads(c.proto.spec) for c in at.get("vega_lite_chart")]
    timeline = next(s for s in specs if s.get("mark", {}).get("type", s.get("mark")) == "line")
    assert timeline["encoding"]["y"]["title"] == "GiB live on rank 0"  # it read "MiB live on rank 0", up to ~2,000
    # its tooltip rounds to 3 decimals with thousands separators (it showed "MiB live on rank 0 1.09087371826")
    tip = {t["field"]: t for t in timeline["encoding"]["tooltip"]}
    assert tip["GiB"]["format"] == ",.3f" and tip["GiB"]["title"] == "GiB live on rank 0" and "phase" in tip


def test_pipeline_fields_add_a_tab_of_stages():
    at = AppTest.from_file(PAGE, default_timeout=300).run()
    at.selectbox(key="parallel.strategy").set_value("none")
    at.number_input(key="parallel.world_size").set_value(2)
    at.number_input(key="parallel.pp").set_value(2)
    at.number_input(key="parallel.microbatches").set_value(2)
    next(b for b in at.button if b.label == "Simulate ranks").click().run()
    assert not at.exception
    # gpt2-tiny, the page's first model, has no Hugging Face decoder to split: one sentence.
    assert any("pipeline parallelism cannot split model 'gpt2'" in e.value for e in at.error)
    at.selectbox(key="config.preset").set_value("llama-tiny")
    next(b for b in at.button if b.label == "Use this model").click().run()
    assert not at.exception and not at.error
    assert [t.label for t in at.tabs] == ["Memory per rank", "Communication in backward", "Pipeline stages", "Plan"]
    stages = next(t.value for t in at.table if "Layers" in t.value.columns)  # a table: a data grid's headers were cut
    # llama-tiny's 2 layers over 2 stages: one layer each, the embedding on stage 0, the head on stage 1.
    assert [v.replace("\\", "") for v in stages["Layers"]] == ["0–0 + embedding", "1–1 + head"]  # markdown escapes
    assert list(stages.index) == [0, 1] and stages.index.name == "Stage"
    # the stage-peak chart's axis in the unit its figures read in: MiB for llama-tiny (it read GiB 0.0000-0.0040)
    import json

    specs = [json.loads(c.proto.spec) for c in at.get("vega_lite_chart")]
    bars = next(s for s in specs if s.get("mark", {}).get("type", s.get("mark")) == "bar")
    assert bars["encoding"]["y"]["title"] == "peak of the stage's rank (MiB)"
    # 1F1B with 2 stages and 2 microbatches: stage 0 runs 2 forwards before its first backward, stage 1 one.
    assert list(stages["Microbatches in flight at peak"]) == [2, 1]
    # the Communication tab counts stage 0's graph for one microbatch (it said "0 autograd nodes" before)
    captions = [c.value for c in at.caption]
    assert any("Rank 0's backward graph for one microbatch (stage 0; each microbatch's is alike) has" in c
               for c in captions)
    assert not any("has 0 autograd nodes" in c for c in captions)
    # the order each rank ran: stage 1 runs microbatch 0 first (torch's listing says 1F1), and the note says so
    order = at.dataframe[-1].value
    assert list(order["Actions"]) == ["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]
    assert any("names 1F1 as action 1 where the runtime ran 1F0" in c for c in captions)


def test_context_parallel_adds_a_tab_with_one_layer_measured_and_counted():
    at = AppTest.from_file(PAGE, default_timeout=300).run()
    at.selectbox(key="config.preset").set_value("llama-tiny")
    next(b for b in at.button if b.label == "Use this model").click().run()
    at.number_input(key="parallel.cp").set_value(2)  # FSDP 8 = data 4 x context 2
    next(b for b in at.button if b.label == "Simulate ranks").click().run()
    assert not at.exception and not at.error
    assert "Context and sequence parallel" in [t.label for t in at.tabs]
    measured = next(m for m in at.metric if m.label == "One layer's activations on rank 0")
    counted = next(m for m in at.metric if m.label == "Counted by hand")
    # 16 of 32 tokens: norms 49,408 + attention 25,088 + SwiGLU 65,536 + ring output copy 8,192 = 148,224 B
    # (tests/test_context_sequence.py derives each term)
    assert measured.value == counted.value == format_bytes(148_224)


def test_the_plan_tab_ranks_layouts_with_peaks_equal_to_their_simulations():
    from graphviz_core.config import resolve_config
    from graphviz_core.parallel.pipeline import simulate_layout
    from graphviz_core.parallel.settings import ParallelConfig

    at = AppTest.from_file(PAGE, default_timeout=300).run()
    # gpt2-tiny on 2 GPUs in nodes of 2, global batch 2, no pipeline: FSDP 2 and TP 2, each with none and full
    # checkpointing (gpt2 takes no pipeline: pp 1 only) = 4 layouts, every one fitting 80 GiB.
    at.number_input(key="plan.gpus").set_value(2)
    at.number_input(key="plan.per_node").set_value(2)
    at.number_input(key="plan.batch").set_value(2)
    at.multiselect(key="plan.pp").set_value([1])
    next(b for b in at.button if b.label == "Plan the layouts").click().run()
    assert not at.exception and not at.error
    frame = next(t for t in tables(at) if "Tokens/s per GPU (estimate)" in t.columns)
    assert sorted(frame["Layout"]) == sorted(["FSDP 2, none, microbatch 1", "FSDP 2, full, microbatch 1",
                                              "TP 2, none, microbatch 1", "TP 2, full, microbatch 1"])
    assert list(frame["Fits"]) == ["yes"] * 4
    # FSDP 2 without checkpointing, a microbatch of 1: the page's peak is the simulator's own for that layout.
    full = simulate_layout(resolve_config("gpt2-tiny", batch=1), ParallelConfig("fsdp", 2), single_device=False)
    row = frame[frame["Layout"] == "FSDP 2, none, microbatch 1"].iloc[0]
    assert row["Peak per GPU"] == format_bytes(full.peak_bytes)


def test_the_help_texts_do_not_repeat_and_name_the_page_button():
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    strategy = at.selectbox(key="parallel.strategy").help
    assert "tensor parallel: tensor parallel" not in strategy and "tensor parallel;" in strategy, strategy
    assert "one device: " not in strategy and strategy.startswith("one device (no parallelism)"), strategy
    assert "DDP: DDP" not in strategy and "DDP (replicate, all-reduce gradients)" in strategy, strategy
    assert "FSDP × TP (2-D): FSDP x tensor parallel (2-D mesh)" in strategy, strategy  # a short name that differs
    assert "then Run" not in at.selectbox(key="config.preset").help  # the button here is "Use this model"
    assert next(b for b in at.button if b.label == "Use this model")


def _simulate(at, **fields):
    for name, value in fields.items():
        widget = at.selectbox(key=f"parallel.{name}") if name == "strategy" else at.number_input(key=f"parallel.{name}")
        widget.set_value(value)
    next(b for b in at.button if b.label == "Simulate ranks").click().run()
    assert not at.exception


def test_refusals_come_one_at_a_time_name_what_is_shown_and_leave_the_link():
    """Issue 33 item 11. Before: a refused TP 3 (4 heads) rewrote the URL to strategy=tp&tp=3; the next refusal said
    the result shown was "tensor parallel over 3 ranks" (never run) and the TP 3 box stayed beside it; pp 4 on
    world 4 said FSDP "needs at least 2 ranks"."""
    at = AppTest.from_file(PAGE, default_timeout=300).run()
    shown = "The result shown is still that of the last layout run (gpt2, FSDP over 8 ranks)."
    _simulate(at, strategy="tp", world_size=3, tp=3)  # valid as a layout; gpt2-tiny's 4 heads refuse it
    assert [e.value.replace("\\", "") for e in at.error] == [
        "Not run: 4 attention heads are not divisible by TP degree 3; each rank needs whole heads. " + shown]
    assert "strategy" not in at.query_params and "tp" not in at.query_params  # the link still names FSDP 8
    _simulate(at, strategy="fsdp+tp", world_size=6, tp=4)  # refused by the form itself
    main_area = [e.value.replace("\\", "") for e in at.main.error]
    assert main_area == ["Not run: world size 6 is not divisible by TP degree 4; the 2-D mesh is (world / TP) x TP. "
                         + shown]
    _simulate(at, strategy="fsdp", world_size=4, tp=1, pp=4, microbatches=4)
    main_area = [e.value.replace("\\", "") for e in at.main.error]
    assert len(main_area) == 1 and main_area[0].endswith(shown)
    assert "world size 4 over 4 stages leaves one rank per stage" in main_area[0]
    assert 'pick "one device" for one rank per stage' in main_area[0]
    assert at.metric[0].value == "65.9 KiB"  # FSDP 8's eighth of gpt2-tiny, still
    assert dict(at.query_params) == {"preset": "gpt2-tiny"}
    _simulate(at, strategy="ddp", world_size=2, pp=1, microbatches=1)  # a layout that runs: the link follows it
    assert not at.error
    assert at.query_params["strategy"] == "ddp" and at.query_params["world_size"] == "2"


def test_sgd_shows_no_optimizer_state_on_one_device_either():
    """SGD keeps no state: 0 B on rank 0 and 0 B on one device (the one-device cell read "—", as if not simulated)."""
    at = AppTest.from_file(PAGE, default_timeout=300)
    at.query_params.update({"preset": "gpt2-tiny", "optimizer": "sgd"})
    at.run()
    assert not at.exception
    beside = next(d.value for d in at.dataframe if "One device" in d.value.columns)
    row = beside[beside[""] == "Optimizer state"].iloc[0]
    assert (row["Rank 0 (as torch laid it out)"], row["Closed form"], row["One device"]) == ("0 B", "0 B", "0 B")
    assert any("One SGD step in steady state" in c.value for c in at.caption)
