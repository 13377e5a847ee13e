"""The form says which config the graph on screen is: a link that names the config by its fields opens with the preset
box reading the preset whose every field it has, else "custom"; a link that cannot be used shows the default, and the
address bar then holds the default too."""

from urllib.parse import parse_qs, urlparse

import pytest

from tests.conftest import idle

pytestmark = pytest.mark.browser

NOT_A_PRESET = "(custom: the fields below)"
LINKS = [
    # mistral-tiny's fields, named by them: the box names it, and so does the address bar
    ("model=mistral&kv_heads=2&intermediate=128", "mistral-tiny", "Mistral", {"preset": ["mistral-tiny"]}),
    ("model=resnet&hidden=8&layers=18&vocab=10&image_size=32", "resnet-tiny", "ResNet (images)", {"preset": ["resnet-tiny"]}),
    # Mistral at the form's defaults (no kv heads, MLP width 4h): no preset has those fields (it read gpt2-tiny)
    ("model=mistral", NOT_A_PRESET, "Mistral", {"model": ["mistral"]}),
    ("model=qwen2&kv_heads=2&intermediate=128&checkpoint=full", NOT_A_PRESET, "Qwen2.5",
     {"model": ["qwen2"], "kv_heads": ["2"], "intermediate": ["128"], "checkpoint": ["full"]}),
    # gpt2 has no grouped-query attention: refused with a notice, the default shown and linked
    ("model=gpt2&kv_heads=2", "gpt2-tiny", "GPT-2 (built in)", {"preset": ["gpt2-tiny"]}),
]


def box(page, label: str) -> str:
    """The value a sidebar selectbox shows (an <input>: not part of inner_text)."""
    return page.locator('[data-testid="stSidebar"]').get_by_role("combobox", name=label, exact=True).input_value()


def test_field_only_links_of_several_families_read_back_from_the_preset_box(page, streamlit_url):
    for query, preset, family, address in LINKS:
        page.goto(f"{streamlit_url}/?{query}")
        page.locator('[data-testid="stCaptionContainer"]', has_text="Loss ").wait_for(timeout=120_000)
        idle(page)
        assert box(page, "Preset") == preset, query
        assert box(page, "Model family") == family, query
        assert parse_qs(urlparse(page.url).query) == address, (query, page.url)
        if preset == "gpt2-tiny":
            page.get_by_text("This link's config could not be used").wait_for(timeout=10_000)
    page.goto("about:blank")
