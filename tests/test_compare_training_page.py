"""AppTests of the compare page's training-step pairs: each button sets B to A with that one setting changed, runs
both captures and shows the pair's sentence (its numbers are checked in tests/test_compare_training.py)."""

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from graphviz_core.config import config_from_preset
from graphviz_core.ui.compare_view import TRAINING_PAIRS

PAGE = str(Path(__file__).resolve().parent.parent / "pages" / "compare.py")
# label -> (the one field B changes, A's value, B's value, how the sentence starts)
EXPECTED = {
    "fp32 vs bf16 autocast": ("autocast", "none", "bfloat16", "autocast none → bfloat16: +23 nodes"),
    "Full fine-tuning vs LoRA": ("finetune", "full", "lora", "finetune 'full' → 'lora'"),
    "Eager vs compiled": ("compile", False, True, "compile False → True"),
    "AdamW vs SGD": ("optimizer", "adamw", "sgd", "optimizer adamw → sgd: no node added or removed"),
}


def _sentences(at) -> list[str]:
    return [m.value.replace("\\", "") for m in at.markdown if m.value.startswith("- ")]


def test_the_four_pairs_are_the_training_row():
    assert list(TRAINING_PAIRS) == list(EXPECTED)


@pytest.mark.parametrize("label", EXPECTED)
def test_each_training_pair_sets_b_to_a_with_one_change_and_says_why(label):
    field, value_a, value_b, start = EXPECTED[label]
    at = AppTest.from_file(PAGE, default_timeout=180).run()
    at.button(key=f"compare.pair.{label}").click().run()
    assert not at.exception and not at.error
    a, b = at.session_state["compare.a.applied"], at.session_state["compare.b.applied"]
    assert (getattr(a, field), getattr(b, field)) == (value_a, value_b)
    # only that field differs (the preset name aside: B is no longer exactly a preset)
    a_fields, b_fields = a.to_dict(), b.to_dict()
    assert [k for k in a_fields if k != "preset" and a_fields[k] != b_fields[k]] == [field]
    # gpt2-tiny (the first visit's A) with sdpa attention, as the page opened
    assert a.model == "gpt2" and a.attention == "sdpa"
    # the B form shows the change (its widget holds B's value)
    assert at.session_state[f"compare.b.{field}"] in (value_b, str(value_b))
    (sentence,) = _sentences(at)
    assert sentence.startswith(f"- {start}"), sentence


def test_eager_vs_compiled_refuses_a_meta_config_a_with_a_sentence():
    # llama-3.1-8b's preset runs on meta (shapes only): torch.compile needs real tensors
    assert config_from_preset("llama-3.1-8b").device == "meta"
    with pytest.raises(ValueError, match="torch.compile runs the step on real tensors and config A runs on meta"):
        TRAINING_PAIRS["Eager vs compiled"](config_from_preset("llama-3.1-8b"))
    # the other three take it: B is A with the one field changed
    for label in ("fp32 vs bf16 autocast", "Full fine-tuning vs LoRA", "AdamW vs SGD"):
        a, b = TRAINING_PAIRS[label](config_from_preset("llama-3.1-8b"))
        field = EXPECTED[label][0]
        assert [k for k, v in a.to_dict().items() if k != "preset" and b.to_dict()[k] != v] == [field]
