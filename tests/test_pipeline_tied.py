"""A head tied to the token embedding under pipeline parallelism (GPT-2 in Hugging Face's implementation, or any family
with tied on): the first stage holds the weight as its embedding, the last a copy as its head (Megatron-LM's layout),
and one all-reduce between those two ranks sums their gradients. GPT-2's later stages run its blocks on the hidden
states they receive, without GPT2Model adding the position embedding to them a second time."""

import inspect

import pytest
import torch

from graphviz_core.config import config_from_preset
from graphviz_core.models.registry import build_model
from graphviz_core.parallel.pipeline import TIED_NOTE, build_stage, simulate_layout
from graphviz_core.parallel.settings import ParallelConfig

GPT2 = config_from_preset("gpt2-hf-tiny", device="cpu")
# gpt2-hf-tiny: h = 64, V = 512, 32 positions, MLP 256, 2 layers. One block: ln_1 2h + c_attn (h x 3h + 3h) + c_proj
# (h x h + h) + ln_2 2h + c_fc (h x 4h + 4h) + mlp c_proj (4h x h + h) = 128 + 12,480 + 4,160 + 128 + 16,640 + 16,448
BLOCK = 49_984
WTE, WPE, LN_F = 512 * 64, 32 * 64, 2 * 64


def test_gpt2_hf_stages_hold_embedding_positions_and_a_copy_of_the_tied_head():
    result = simulate_layout(GPT2.replace(device="meta"), ParallelConfig("fsdp", 4, pp=2, microbatches=2),
                             single_device=False)
    stages = result.pipeline.per_stage
    # float32, FSDP over the stage's 2 data-parallel ranks: each holds half of its stage's parameters
    assert stages[0].parameter_bytes == 4 * (WTE + WPE + BLOCK) // 2 == 169_600  # wte, wpe, block 0
    assert stages[1].parameter_bytes == 4 * (BLOCK + LN_F + WTE) // 2 == 165_760  # block 1, ln_f, the head's copy
    summed = [c for c in result.collectives if c.group == "embedding"]
    # rank 0 (stage 0) and rank 2 (stage 1, the same data-parallel place): this rank's half of the 512 x 64 weight
    assert [(c.kind, c.buffer_bytes, c.ranks) for c in summed] == [("all_reduce", 4 * WTE // 2, (0, 2))]
    assert TIED_NOTE in result.notes


def _stage_with_weights(full: torch.nn.Module, bounds: tuple[int, int], first: bool, last: bool):
    """The stage build_stage cuts (on meta), given the full model's weights: layer i of the stage is layer
    bounds[0] + i of the model."""
    stage = build_stage(GPT2, bounds, first, last)
    stage.to_empty(device="cpu")
    weights = dict(full.named_parameters(remove_duplicate=False))  # lm_head.weight is wte.weight
    with torch.no_grad():
        for name, param in stage.named_parameters():
            path = name.removeprefix("model.")
            if path.startswith("transformer.h."):
                index, rest = path.removeprefix("transformer.h.").split(".", 1)
                path = f"transformer.h.{int(index) + bounds[0]}.{rest}"
            param.copy_(weights[path])
    return stage


def test_gpt2_hf_stages_in_turn_compute_the_models_own_logits():
    """The two stages run one after the other on real weights give the whole model's logits: the later stage adds no
    second position embedding (GPT2Model.forward with inputs_embeds would: inputs_embeds + wpe(position_ids))."""
    torch.manual_seed(0)
    full = build_model(GPT2)
    tokens = torch.randint(0, GPT2.vocab, (2, GPT2.seq))
    first = _stage_with_weights(full, (0, 1), True, False)
    last = _stage_with_weights(full, (1, 2), False, True)
    assert not hasattr(last.model.transformer, "wpe") or last.model.transformer.wpe is None
    assert last.tied == "model.lm_head" and first.tied == "model.transformer.wte"
    with torch.no_grad():
        expected = full(input_ids=tokens).logits
        piped = last(first(tokens))
        # what GPT2Model's own forward would give the last stage: the position embedding added twice
        twice = full(inputs_embeds=full.transformer.wte(tokens) + full.transformer.wpe(torch.arange(GPT2.seq))).logits
    assert piped.shape == (2, GPT2.seq, GPT2.vocab)
    torch.testing.assert_close(piped, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(twice, expected, atol=1e-3)


def test_tied_llama_runs_under_pipelines_with_the_same_sum():
    """llama-tiny with tied on, once refused under pipelines ("untie them"): the same layout, the same all-reduce."""
    config = config_from_preset("llama-tiny", device="meta", tied=True)
    result = simulate_layout(config, ParallelConfig("none", 2, pp=2, microbatches=2), single_device=False)
    summed = [c for c in result.collectives if c.group == "embedding"]
    assert [(c.kind, c.buffer_bytes) for c in summed] == [("all_reduce", 4 * 512 * 64)]  # V x h, float32


def _old_keywords(real, cache_name: str, embeds_name: str, cache_position: bool):
    """transformers' create_causal_mask as an earlier 5.x release names its keywords (5.17: `past_key_values`; the
    first 5.x releases also `input_embeds` and a required `cache_position`), handing on to this install's function:
    a call with the newest names fails, as it does on those releases (there a TypeError, here the assertion)."""

    def create_causal_mask(config, attention_mask, position_ids=None, **named):
        assert set(named) == {embeds_name, cache_name} | ({"cache_position"} if cache_position else set()), named
        return real(config=config, inputs_embeds=named[embeds_name], attention_mask=attention_mask, cache=None,
                    position_ids=position_ids)

    names = ["config", embeds_name, "attention_mask", cache_name, *(["cache_position"] if cache_position else [])]
    create_causal_mask.__signature__ = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in names]
        + [inspect.Parameter("position_ids", inspect.Parameter.KEYWORD_ONLY, default=None)])
    return create_causal_mask


@pytest.mark.parametrize(("cache_name", "embeds_name", "cache_position"),
                         [("past_key_values", "inputs_embeds", False), ("past_key_values", "input_embeds", True)])
def test_gpt2_hf_later_stages_build_their_mask_under_earlier_transformers_keywords(monkeypatch, cache_name,
                                                                                    embeds_name, cache_position):
    """pyproject allows transformers 5.0 to 5.x: 5.17's create_causal_mask takes `past_key_values` where 5.24's takes
    `cache` (a GPU box with 5.17 failed both stage tests above with "unexpected keyword argument 'cache'"). The later
    stage asks for the keywords its install takes, and still gives the whole model's logits."""
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401 - imported before the patch: it binds the function
    from transformers import masking_utils  # at import, and GPT2Model's own forward must keep the real one

    real = masking_utils.create_causal_mask
    if "cache" not in inspect.signature(real).parameters:
        pytest.skip("this install's create_causal_mask is an earlier one already: the tests above cover it")
    monkeypatch.setattr(masking_utils, "create_causal_mask", _old_keywords(real, cache_name, embeds_name,
                                                                            cache_position))
    test_gpt2_hf_stages_in_turn_compute_the_models_own_logits()
