"""Pictures for the README and docs.

`python -m graphviz_core.ui.screenshot OUT.png [--path PAGE]` starts the app, opens it in headless Chromium,
waits until vis-network has drawn, and saves a PNG. `python -m graphviz_core.ui.screenshot --gallery DIR`
(`make docs-images`) regenerates the gallery: each preset's graph, the toy stepper at three steps, and the
memory and FLOP panels, every picture at the size GALLERY_SIZES names, plus an index.md that lists them.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

from graphviz_core.ui.browser_harness import CHROMIUM, CHROMIUM_ARGS, NO_RUN, graph_frame, serve_app

# CSS pixels x device pixels per CSS pixel, per kind of picture. Graphs at 2x like the app's "Download PNG";
# app pages at 1x (text and charts, already legible at 1440 wide).
GRAPH_SIZE, GRAPH_SCALE = (1600, 1000), 2
PAGE_SIZE, PAGE_SCALE = (1440, 1000), 1
TOY_STEPS = (1, 3, 6)  # "Transformer Math"'s (a*b + c)**2 has 6 backward steps: the first, the middle, the last
# Above this many nodes a whole graph fitted into one picture is unreadable: show shape ops hidden, modules
# collapsed and the first layer expanded instead (the page's own view controls, so the picture is reproducible).
COLLAPSE_ABOVE = 300


def gallery_sizes() -> dict[str, tuple[int, int]]:
    """Each gallery file's name and its size in pixels (what `--gallery` writes and the tests check)."""
    from graphviz_core.config import PRESETS

    graph = (GRAPH_SIZE[0] * GRAPH_SCALE, GRAPH_SIZE[1] * GRAPH_SCALE)
    page = (PAGE_SIZE[0] * PAGE_SCALE, PAGE_SIZE[1] * PAGE_SCALE)
    sizes = {f"graph-{name}.png": graph for name in PRESETS}
    sizes.update({f"toy-step-{step}.png": page for step in TOY_STEPS})
    sizes.update({"panel-memory.png": page, "panel-flops.png": page})
    return sizes


def _compact(png: bytes) -> bytes:
    """The same picture as a palette PNG: graphs and app pages have few colours, so ~3x smaller in git."""
    try:
        from PIL import Image
    except ImportError:  # Pillow ships with Streamlit; without it the PNG stays as Chromium wrote it
        return png
    image = Image.open(io.BytesIO(png)).convert("RGB")
    out = io.BytesIO()
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(out, "PNG", optimize=True)
    return out.getvalue()


def _first_layer(graph) -> str | None:
    """The module group of layer 0 ("blocks.0", "model.layers.0", "resnet.encoder.stages.0"): of the groups
    numbered 0, the one with the most nodes (a ResNet's "classifier.0" is a lone Flatten); None if there is none."""
    from collections import Counter

    from graphviz_core.graph.views import module_group

    sizes = Counter(module_group(d["module"], 2) for _, d in graph.nodes(data=True))
    zeros = [g for g in sizes if g and g.rsplit(".", 1)[-1] == "0"]
    return max(zeros, key=lambda g: sizes[g], default=None)


def preset_graph_png(name: str, size: tuple[int, int] = GRAPH_SIZE, scale: int = GRAPH_SCALE) -> tuple[bytes, str]:
    """The preset's captured graph as a PNG, and one line saying what the picture shows."""
    from graphviz_core.capture.engine import capture_backward
    from graphviz_core.config import config_from_preset
    from graphviz_core.export.formats import to_png
    from graphviz_core.export.render import render_html, run_description
    from graphviz_core.ui.graph_view import apply_view

    capture = capture_backward(config_from_preset(name))
    config, graph = capture.config, capture.graph
    shown = f"all {graph.number_of_nodes():,} nodes"
    if graph.number_of_nodes() > COLLAPSE_ABOVE:
        layer = _first_layer(graph)
        graph = apply_view(capture, focus=None, hide_shape=True, collapse=True, expanded=layer)
        shown = (f"{graph.number_of_nodes():,} of {capture.graph.number_of_nodes():,} nodes: shape ops hidden, "
                 f"modules collapsed" + (f", {layer} expanded" if layer else ""))
    subtitle = f"{run_description(config, capture.device)} · {shown}"
    html = render_html(graph, title=f"autograd graph: {name}", subtitle=subtitle, height_px=size[1])
    return to_png(html, width=size[0], height=size[1], scale=scale), subtitle


def _settled(page) -> None:
    """Wait until Streamlit has finished its script run and the page has stopped moving."""
    page.wait_for_function(NO_RUN, timeout=120_000, polling=100)
    page.wait_for_timeout(1500)


def _scroll_to(page, locator) -> None:
    """Scroll Streamlit's own scroll container so `locator` sits at the top of the viewport."""
    locator.first.evaluate("e => e.scrollIntoView({block: 'start'})")
    page.wait_for_timeout(800)


def app_pictures(out: Path) -> dict[str, str]:
    """The toy stepper at TOY_STEPS and the memory and FLOP panels, from the live app; file -> caption."""
    from playwright.sync_api import sync_playwright

    captions = {}
    with serve_app({"GRAPHVIZ_CORE_DEVICE": "cpu"}) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": PAGE_SIZE[0], "height": PAGE_SIZE[1]},
                                    device_scale_factor=PAGE_SCALE)
            page.goto(url)
            graph_frame(page, timeout_s=180)
            _settled(page)
            for tab, file, caption in (("Memory", "panel-memory.png", "Memory panel (gpt2-tiny): peak, timeline"),
                                       ("FLOPs and time", "panel-flops.png", "FLOPs and time panel (gpt2-tiny)")):
                page.get_by_role("tab", name=tab).click()
                _settled(page)
                _scroll_to(page, page.get_by_role("tab", name=tab))
                (out / file).write_bytes(_compact(page.screenshot(type="png")))
                captions[file] = caption
            page.goto(f"{url}/toy_expressions")
            graph_frame(page, 6, timeout_s=120)  # "Transformer Math": L, e, d and the variables a, b, c
            _settled(page)
            step = 0
            for target in TOY_STEPS:
                while step < target:
                    page.get_by_role("button", name="Next ›").click()
                    step += 1
                    page.get_by_text(f"Step {step} of").first.wait_for(timeout=30_000)
                _settled(page)
                graph_frame(page, 6)
                _scroll_to(page, page.get_by_text("Backward step", exact=True))
                file = f"toy-step-{target}.png"
                (out / file).write_bytes(_compact(page.screenshot(type="png")))
                captions[file] = f"Toy stepper, (a*b + c)**2 at a=2, b=-3, c=10: step {target} of 6"
        finally:
            browser.close()
    return captions


def gallery(out: Path, presets: list[str] | None = None, app: bool = True) -> dict[str, str]:
    """Write the gallery into `out` (every preset unless `presets` names some); file -> caption."""
    from graphviz_core.config import PRESETS

    out.mkdir(parents=True, exist_ok=True)
    captions = {}
    for name in presets or list(PRESETS):
        started = time.perf_counter()
        png, what = preset_graph_png(name)
        (out / f"graph-{name}.png").write_bytes(_compact(png))
        captions[f"graph-{name}.png"] = f"{name}: {what}"
        sys.stderr.write(f"graph-{name}.png  {time.perf_counter() - started:.1f} s\n")
    if app:
        captions.update(app_pictures(out))
    return captions


def _index(captions: dict[str, str]) -> str:
    lines = ["# Gallery", "", "Regenerated by `make docs-images` (graphviz_core/ui/screenshot.py); do not edit by hand.", ""]
    for file, caption in _in_gallery_order(captions).items():
        lines += [f"## {file.removesuffix('.png')}", "", caption, "", f"![{caption}]({file})", ""]
    return "\n".join(lines)


def _in_gallery_order(captions: dict[str, str]) -> dict[str, str]:
    order = list(gallery_sizes())
    return dict(sorted(captions.items(), key=lambda item: order.index(item[0]) if item[0] in order else len(order)))


def _captions_in(index: Path) -> dict[str, str]:
    """file -> caption of every picture an index.md lists (`![caption](file)`)."""
    found = {}
    for line in index.read_text(encoding="utf-8").splitlines() if index.exists() else []:
        if line.startswith("![") and line.endswith(".png)"):
            caption, _, file = line[2:-1].rpartition("](")
            found[file] = caption
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", nargs="?", help="one screenshot of the app: the PNG to write")
    parser.add_argument("--path", default="", help="page path, e.g. toy_expressions")
    parser.add_argument("--width", type=int, default=1500)
    parser.add_argument("--height", type=int, default=1300)
    parser.add_argument("--gallery", metavar="DIR", help="regenerate the gallery in DIR (assets/gallery)")
    parser.add_argument("--presets", nargs="*", help="with --gallery: only these presets' graphs, no app pictures")
    args = parser.parse_args(argv)
    if args.gallery:
        out = Path(args.gallery)
        captions = gallery(out, args.presets, app=not args.presets)
        if args.presets:  # the other pictures stay as they are, and so do their captions
            captions = {**_captions_in(out / "index.md"), **captions}
        (out / "index.md").write_text(_index(captions), encoding="utf-8")
        sys.stderr.write(f"wrote {len(captions)} pictures to {out}\n")
        return 0
    if not args.output:
        parser.error("give OUT.png or --gallery DIR")
    from playwright.sync_api import sync_playwright

    with serve_app({"GRAPHVIZ_CORE_DEVICE": "cpu"}) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": args.width, "height": args.height})
        page.goto(f"{url}/{args.path}")
        graph_frame(page, timeout_s=90)
        # Streamlit applies st.navigation and the page config when the script run ends; wait for that.
        _settled(page)
        page.wait_for_timeout(1000)
        page.screenshot(path=args.output, full_page=True)
        browser.close()
    sys.stderr.write(f"wrote {args.output}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
