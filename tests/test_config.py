"""ModelConfig validation and presets: bad values raise ValueError with a sentence a person can act on."""

import dataclasses

import pytest

from graphviz_core.config import PRESETS, ModelConfig, config_from_preset, resolve_config


def test_hidden_not_divisible_by_heads_says_what_to_do():
    with pytest.raises(ValueError, match=r"hidden 770 is not divisible by 12 heads.*multiple of 12 \(e\.g\. 768\)"):
        ModelConfig(hidden=770, heads=12)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(batch=0), "batch must be positive, got 0"),
        (dict(seq=-3), "seq must be positive, got -3"),
        (dict(layers=1.5), "layers must be a whole number"),
        (dict(model="resnet"), "unknown model 'resnet'; choose one of: mlp, block, gpt2"),
        (dict(attention="flash"), "unknown attention 'flash'"),
        (dict(device="tpu"), "unknown device 'tpu'"),
        (dict(dtype="int8"), "unknown dtype 'int8'"),
        (dict(hidden=10**6), "hidden 1000000 is above the limit"),
        (dict(seq=64, context=32), "seq 64 is longer than the context 32"),
        (dict(model="block", layers=3), "exactly one transformer block; layers must be 1"),
        (dict(model="mlp", attention="manual"), "model 'mlp' has no attention"),
    ],
)
def test_bad_values_raise_actionable_errors(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig(**fields)


def test_config_is_frozen():
    config = ModelConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden = 128


def test_presets_hold_the_shapes_the_issue_names():
    small = config_from_preset("gpt2-small")
    assert (small.layers, small.hidden, small.heads, small.vocab, small.positions) == (12, 768, 12, 50257, 1024)
    block = config_from_preset("seed-block")
    assert (block.model, block.hidden, block.heads, block.attention) == ("block", 768, 12, "mha")
    llama = config_from_preset("llama-70b-shape")
    assert (llama.layers, llama.hidden, llama.heads, llama.seq, llama.batch, llama.dtype, llama.device) == (
        80, 8192, 64, 8192, 1, "bfloat16", "meta")
    assert "GPT-2-style blocks" in PRESETS["llama-70b-shape"].description
    assert config_from_preset("gpt2-tiny").model == "gpt2"


def test_flags_override_preset_fields_and_none_is_ignored():
    config = resolve_config("gpt2-tiny", batch=5, seq=None)
    assert config.batch == 5 and config.seq == config_from_preset("gpt2-tiny").seq


def test_model_without_preset_starts_from_that_models_defaults():
    assert resolve_config(model="block").layers == 1
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        resolve_config("nope")
