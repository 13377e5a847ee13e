"""The docs gallery (assets/gallery, `make docs-images`): every picture a valid, non-blank PNG of its size."""

import io
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from graphviz_core.ui.screenshot import TOY_STEPS, gallery_sizes, preset_graph_png

GALLERY = Path(__file__).resolve().parent.parent / "assets" / "gallery"


def header_size(data: bytes) -> tuple[int, int]:
    """Width and height from the PNG header: the 8-byte signature, then the IHDR chunk (length, type, w, h)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def check_picture(data: bytes, size: tuple[int, int]) -> None:
    """A complete PNG of `size` pixels with something drawn on it."""
    assert header_size(data) == size
    image = Image.open(io.BytesIO(data))
    image.load()  # decodes every row: a truncated or corrupt file raises here
    assert image.size == size
    rgb = np.asarray(image.convert("RGB")).astype(int)
    # a blank (one-colour) picture has standard deviation 0; a page of text, boxes and charts is far above 10
    assert rgb.std() > 10, f"blank picture (pixel std {rgb.std():.1f})"
    packed = (rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]  # one int per colour
    assert len(np.unique(packed)) > 16  # text, fills and lines, not a two-colour slab


def test_the_check_refuses_a_blank_picture():
    out = io.BytesIO()
    Image.new("RGB", (64, 48), "white").save(out, "PNG")
    with pytest.raises(AssertionError, match="blank picture"):
        check_picture(out.getvalue(), (64, 48))


def test_the_gallery_names_each_preset_three_toy_steps_and_two_panels():
    from graphviz_core.config import PRESETS

    sizes = gallery_sizes()
    assert len(sizes) == len(PRESETS) + len(TOY_STEPS) + 2
    assert TOY_STEPS == (1, 3, 6)  # "Transformer Math"'s (a*b + c)**2 has 6 backward steps: first, middle, last


@pytest.mark.parametrize(("file", "size"), sorted(gallery_sizes().items()))
def test_gallery_picture_is_a_valid_non_blank_png_of_its_size(file, size):
    check_picture((GALLERY / file).read_bytes(), size)


def test_gallery_index_shows_every_picture():
    index = (GALLERY / "index.md").read_text(encoding="utf-8")
    assert all(f"]({file})" in index for file in gallery_sizes())


@pytest.mark.browser
def test_a_small_presets_graph_renders_to_a_png_of_the_requested_size():
    # the PNG path `make docs-images` takes, on the smallest preset: 640x480 CSS pixels at 2x = 1280x960
    png, what = preset_graph_png("mlp", size=(640, 480), scale=2)
    check_picture(png, (1280, 960))
    assert what.endswith("all 26 nodes")  # mlp: 26 nodes (test_capture), under COLLAPSE_ABOVE: drawn whole
    # the picture's subtitle is the app's (the device it ran on, once: not "auto · cpu")
    assert what.startswith("mlp · 2 layers · h=64 · b=4 · s=8 · float32 · cpu · no checkpointing · all 26")
