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
        (dict(model="resnet50"), "unknown model 'resnet50'; choose one of: mlp, block, gpt2"),
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
    block = config_from_preset("transformer-block")
    assert (block.model, block.hidden, block.heads, block.attention) == ("block", 768, 12, "mha")
    llama = config_from_preset("llama-3.1-70b")
    # Llama 3.1 70B's published config: 80 layers, h=8192, 64 query / 8 key-value heads, SwiGLU 28672, V=128256
    assert (llama.model, llama.layers, llama.hidden, llama.heads, llama.kv_heads, llama.intermediate, llama.vocab) == (
        "llama", 80, 8192, 64, 8, 28672, 128256)
    assert (llama.seq, llama.batch, llama.dtype, llama.device) == (8192, 1, "bfloat16", "meta")
    # llama-70b-shape was the same config under a second name: the name still gives it, as the preset it became
    assert config_from_preset("llama-70b-shape") == llama and "llama-70b-shape" not in PRESETS
    old = config_from_preset("gpt2-blocks-at-llama-70b-width")
    assert old.model == "gpt2" and "GPT-2-style blocks" in PRESETS["gpt2-blocks-at-llama-70b-width"].description
    assert config_from_preset("gpt2-tiny").model == "gpt2"


def test_flags_override_preset_fields_and_none_is_ignored():
    config = resolve_config("gpt2-tiny", batch=5, seq=None)
    assert config.batch == 5 and config.seq == config_from_preset("gpt2-tiny").seq


def test_model_without_preset_starts_from_that_models_defaults():
    assert resolve_config(model="block").layers == 1
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        resolve_config("nope")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(model="llama", heads=4, kv_heads=3), "4 heads are not divisible by 3 key-value heads"),
        (dict(model="gpt2", kv_heads=2), "model 'gpt2' has no key-value heads"),
        (dict(model="mixtral", experts=4, experts_per_token=5), "experts_per_token 5 is more than the 4 experts"),
        (dict(model="mixtral"), "needs experts and experts_per_token"),
        (dict(model="vit", image_size=30), "not a multiple of ViT's 16-pixel patches"),
        (dict(model="resnet", layers=20, image_size=32), "one of 18, 34, 50, 101, 152"),
        (dict(model="llama", attention="mha"), "choose sdpa or eager"),
        (dict(model="gpt2", attention="eager"), "attention 'eager' is for the transformers families"),
        (dict(seed=-1), "seed must be between 0 and 2,147,483,647, got -1"),
        (dict(seed=2**64 - 1), "seed must be between 0"),
        (dict(model="bert", image_size=32), "model 'bert' has no image size"),
    ],
)
def test_family_rules_refuse_with_the_fix(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig(**fields)


def test_a_field_the_family_does_not_have_is_refused_not_ignored():
    with pytest.raises(ValueError, match="model 'vit' has no sequence length"):
        resolve_config(model="vit", seq=128)
    with pytest.raises(ValueError, match="model 'resnet' has no attention heads"):
        resolve_config("resnet-tiny", heads=8)


def test_every_family_has_a_tiny_preset_and_its_model_defaults_are_it():
    from graphviz_core.config import MODEL_DEFAULTS
    from tests.conftest import HF_FAMILIES

    for family in HF_FAMILIES:
        assert PRESETS[f"{family}-tiny"].fields["model"] == family
        assert resolve_config(model=family) == ModelConfig(**MODEL_DEFAULTS[family])


def test_describe_names_the_config_by_its_fields():
    assert ModelConfig(model="llama", hidden=64, heads=4, kv_heads=2, layers=2).describe().startswith(
        "llama · 2 layers · h=64 · 4 heads / 2 kv")
