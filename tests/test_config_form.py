"""The sidebar form (AppTest): family fields shown or hidden, refused configs keep the previous result, stale results
are flagged, and the config is named by what it is."""

from pathlib import Path

import torch
from streamlit.testing.v1 import AppTest

from tests.conftest import captured, plain

APP = str(Path(__file__).resolve().parent.parent / "app.py")


def run(at) -> None:
    next(b for b in at.button if b.label == "Run backward pass").click().run()


def labels(at) -> set[str]:
    return {w.label for w in at.sidebar.number_input}


def test_refused_sizes_and_seed_give_one_message_and_keep_the_result():
    at = AppTest.from_file(APP, default_timeout=120).run()
    nodes = at.metric[0].value
    for field, value, message in [
        ("batch", 0, "batch must be positive, got 0"),
        ("layers", 300, "layers 300 is above the limit of 256"),
        ("seed", -1, "seed must be between 0 and 2,147,483,647, got -1"),
    ]:
        at.number_input(key=f"config.{field}").set_value(value)
        run(at)
        assert not at.exception
        assert [e for e in at.sidebar.error if message in e.value.replace("\\", "")], field  # escaped Markdown
        # and in the main area, beside the results, where it is seen after pressing Run at the sidebar's foot
        assert [e for e in at.main.error if message in e.value.replace("\\", "")], field
        assert at.metric[0].value == nodes  # the previous capture is still on the page
        at.number_input(key=f"config.{field}").set_value(captured("gpt2-tiny").config.to_dict()[field])


def test_cuda_is_offered_only_where_it_exists():
    at = AppTest.from_file(APP, default_timeout=120).run()
    options = at.selectbox(key="config.device").options
    assert ("cuda" in options) == torch.cuda.is_available()


def test_a_family_shows_its_own_fields_and_runs_from_the_form():
    at = AppTest.from_file(APP, default_timeout=120).run()
    at.selectbox(key="config.model").set_value("resnet").run()
    # ResNet has no heads or sequence; it has images and classes
    assert {"Image size (pixels)", "Classes", "Depth (18, 34, 50, 101, 152)"} <= labels(at)
    assert not {"Attention heads", "Sequence length", "Key-value heads"} & labels(at)
    assert any("form differs" in w.value for w in at.sidebar.warning)  # the graph shown is still gpt2-tiny's
    run(at)
    assert not at.exception
    assert at.metric[0].value == f"{captured('resnet-tiny').summary.nodes:,}"
    assert not at.sidebar.warning
    at.selectbox(key="config.model").set_value("mixtral").run()
    assert {"Key-value heads", "Experts", "Experts per token", "MLP width"} <= labels(at)
    assert at.selectbox(key="config.attention").options == ["sdpa", "eager"]


def test_an_edited_preset_is_named_by_its_fields():
    at = AppTest.from_file(APP, default_timeout=120).run()
    at.number_input(key="config.layers").set_value(1)
    run(at)
    caption = plain(next(c.value for c in at.caption if c.value.startswith("Loss")))
    assert "preset" not in caption and "gpt2 · 1 layer · h=64" in caption


FACTORY = """
import torch

def make():
    return torch.nn.Linear(4, 2), torch.randn(3, 4), lambda out: out.pow(2).mean()

def _helper():
    pass

def needs_args(x):
    pass
"""


def test_user_models_only_from_a_trusted_folder_named_at_startup(tmp_path, monkeypatch):
    at = AppTest.from_file(APP, default_timeout=120).run()
    assert not [b for b in at.button if b.label == "Run your model"]  # no opt-in: no user code at all
    (tmp_path / "net.py").write_text(FACTORY)
    monkeypatch.setenv("GRAPHVIZ_CORE_TRUSTED_MODEL_DIR", str(tmp_path))
    at = AppTest.from_file(APP, default_timeout=120).run()
    # listed by parsing: only the public function without required arguments
    assert at.selectbox(key="config.custom").options == ["net.py:make"]
    next(b for b in at.button if b.label == "Run your model").click().run()
    assert not at.exception
    # Linear(4, 2) + Pow + Mean: Addmm, T, 2 parameter leaves, Pow, Mean = 6 nodes
    assert at.metric[0].value == "6"


def test_a_refused_family_config_keeps_the_result():
    at = AppTest.from_file(APP, default_timeout=120).run()
    nodes = at.metric[0].value
    at.selectbox(key="config.model").set_value("llama").run()
    at.number_input(key="config.kv_heads").set_value(3)
    run(at)
    assert [e for e in at.sidebar.error if "not divisible by 3 key-value heads" in e.value.replace("\\", "")]
    assert at.metric[0].value == nodes


def test_the_form_keeps_its_model_from_the_explorer_to_beyond_one_gpu():
    """A walkthrough opened ?preset=gpt2-tiny in the explorer, then Beyond one GPU from the sidebar: the family read
    MLP and hidden, layers, batch and seq 0 (Streamlit drops a widget's value after a run that did not draw it; both
    pages draw the same form), and its button refused 'hidden must be positive, got 0'. gpt2-tiny: h=64, 2 layers."""
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params["preset"] = "gpt2-tiny"
    at.run()
    at.switch_page("pages/parallel.py").run()
    assert not at.exception
    assert at.selectbox(key="config.preset").value == "gpt2-tiny"
    assert at.selectbox(key="config.model").value == "gpt2"
    assert (at.number_input(key="config.hidden").value, at.number_input(key="config.layers").value) == (64, 2)
    assert not [w.value for w in at.sidebar.warning]  # the form is the model applied: nothing stale to flag
    at.switch_page("pages/graph_explorer.py").run()  # and back
    assert at.number_input(key="config.hidden").value == 64 and not at.exception


NOT_A_PRESET = "(custom: the fields below)"  # what the preset box reads for a config that is none of the presets


def _link(params: dict) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update(params)
    return at.run()


def test_a_link_by_fields_shows_the_preset_it_is_or_says_custom():
    # mistral-tiny's own fields, named by them (as a link from a form that dropped the preset's name): the box names
    # mistral-tiny and the address bar says so
    at = _link({"model": "mistral", "kv_heads": "2", "intermediate": "128"})
    assert not at.exception
    assert at.selectbox(key="config.preset").value == "mistral-tiny"
    assert {k: at.query_params[k] for k in at.query_params} == {"preset": "mistral-tiny"}
    # ?model=mistral alone is Mistral at the form's defaults (kv_heads 0, intermediate 0): no preset has those fields,
    # so the box says custom; it read gpt2-tiny beside a Mistral graph
    at = _link({"model": "mistral"})
    assert at.selectbox(key="config.preset").value == NOT_A_PRESET
    assert at.selectbox(key="config.model").value == "mistral"
    assert "config: mistral · 2 layers · h=64 · 4 heads · " in plain(next(c.value for c in at.caption if c.value.startswith("Loss")))
    assert any(c.value.startswith("None of the presets") for c in at.sidebar.caption)


def test_running_edited_fields_sets_the_box_to_custom_and_back_to_the_preset():
    at = AppTest.from_file(APP, default_timeout=120).run()
    assert at.selectbox(key="config.preset").value == "gpt2-tiny"
    at.number_input(key="config.layers").set_value(1)
    run(at)
    assert at.selectbox(key="config.preset").value == NOT_A_PRESET
    at.number_input(key="config.layers").set_value(2)  # gpt2-tiny's 2 layers again: it is that preset once more
    run(at)
    assert at.selectbox(key="config.preset").value == "gpt2-tiny"
    assert {k: at.query_params[k] for k in at.query_params} == {"preset": "gpt2-tiny"}


def test_a_link_that_cannot_be_used_shows_the_default_and_the_address_bar_says_so():
    at = _link({"model": "gpt2", "kv_heads": "2"})  # gpt2 has no grouped-query attention
    assert any("config could not be used" in w.value for w in at.warning)
    assert at.selectbox(key="config.preset").value == "gpt2-tiny"
    assert {k: at.query_params[k] for k in at.query_params} == {"preset": "gpt2-tiny"}


def test_a_zero_size_says_the_default_it_stands_for_and_help_names_only_offered_kernels():
    at = AppTest.from_file(APP, default_timeout=120).run()
    assert at.selectbox(key="config.attention").options == ["sdpa", "mha", "manual"]  # gpt2's: no eager
    assert "eager" not in at.selectbox(key="config.attention").help
    assert "selective:" not in at.selectbox(key="config.checkpoint").help  # an alias the list does not offer
    assert "0 means the default: the sequence length. The result shown used 32 tokens." in at.number_input(
        key="config.context").help  # gpt2-tiny: context 0, seq 32 (its unit, from the declaration)
    at.selectbox(key="config.preset").set_value("llama-tiny").run()
    at.number_input(key="config.intermediate").set_value(0)
    at.number_input(key="config.kv_heads").set_value(0)
    run(at)
    assert not at.exception and not at.sidebar.error
    # llama-tiny: hidden 64, 4 heads -> MLP width 4 x 64 = 256, key-value heads = the 4 heads
    assert ("0 means the default: Key-value heads 4 (one per attention head, no grouped-query attention); "
            "MLP width 256 (4 × hidden size).") in [c.value for c in at.sidebar.caption]
    assert at.number_input(key="config.intermediate").help.endswith("The result shown used 256.")
    assert at.number_input(key="config.kv_heads").help.endswith("The result shown used 4.")


def test_refusals_name_the_forms_labels_not_the_config_fields():
    at = AppTest.from_file(APP, default_timeout=120).run()
    at.number_input(key="config.hidden").set_value(10)  # gpt2-tiny's 4 heads do not divide 10
    run(at)
    errors = [e.value.replace("\\", "") for e in at.sidebar.error]  # escaped Markdown
    assert any(e.startswith("Not run: “Hidden size” 10 is not divisible by 4 heads") for e in errors), errors
    at.number_input(key="config.hidden").set_value(64)
    at.number_input(key="config.seq").set_value(40)
    at.number_input(key="config.context").set_value(32)
    run(at)
    errors = [e.value.replace("\\", "") for e in at.sidebar.error]
    assert any("“Sequence length” 40 is longer than the context 32" in e and "lower “Sequence length”" in e
               for e in errors), errors
