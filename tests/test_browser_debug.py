"""The explorer's Debug tab in headless Chromium: llama-tiny with LoRA, whose 4 A matrices get an exactly zero
gradient on the step (B starts at zero, and the step shown has no optimizer update): the tab lists them, and choosing
one opens the recorded graph with that A's AccumulateGrad node selected and the path from the loss ringed. The forward
check's box changes what runs (the caption says every op was checked). No page error, no request outside the server."""

import os

import pytest

from graphviz_core.analysis.gradient_flow import analyse_config
from graphviz_core.config import resolve_config
from graphviz_core.ui.browser_harness import graph_frame
from graphviz_core.ui.findings import finding_label
from tests.conftest import LAPTOP, both_sizes, choose, idle

pytestmark = pytest.mark.browser
SHOTS = os.environ.get("GRAPHVIZ_CORE_SHOTS")


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_a_finding_opens_at_its_parameters_node_in_the_explorer(page, streamlit_url, tmp_path):
    outside = []
    page.on("request", lambda r: outside.append(r.url) if not r.url.startswith((streamlit_url, "data:", "about:",
                                                                                "blob:")) else None)
    page.goto(f"{streamlit_url}/?preset=llama-tiny&finetune=lora&tab=Debug")
    box = page.get_by_role("combobox", name="Open a finding at its node")
    box.wait_for(timeout=120_000)
    idle(page, settle_ms=500)
    main = page.locator('[data-testid="stMain"]')
    assert "4 findings." in main.inner_text()
    # the findings table fits its column at 1280 px: the parameter names break after their dots (it ran 380 px past
    # it, the source and reason columns off the page's edge)
    table = page.locator('[data-testid="stTable"]').first
    wide = table.evaluate("e => [e.scrollWidth, e.clientWidth, e.querySelector('table').getBoundingClientRect().width]")
    assert wide[0] <= wide[1] + 1 and wide[2] <= wide[1] + 1, wide
    findings = analyse_config(resolve_config("llama-tiny", finetune="lora"))["findings"]
    wanted = next(f for f in findings if f["parameter"] == "model.layers.1.self_attn.v_proj.lora_A.default.weight")
    choose(page, box, finding_label(wanted))
    idle(page, settle_ms=1000)
    frame = graph_frame(page, timeout_s=90)
    shown = frame.evaluate("() => ({selected: window.network.getSelectedNodes(), "
                           "details: document.getElementById('details').innerText})")
    assert len(shown["selected"]) == 1 and shown["selected"][0].startswith("AccumulateGrad:")
    assert "model.layers.1.self_attn.v_proj.lora_A.default.weight" in shown["details"]
    assert "nodes from the loss down to it ringed in pink" in main.inner_text()
    both_sizes(page, os.path.join(SHOTS or str(tmp_path), "explorer-debug"))
    page.get_by_text("Also check every op of the forward", exact=False).click()
    page.get_by_text("every op of the forward checked", exact=False).first.wait_for(timeout=120_000)
    assert page.locator('[data-testid="stException"]').count() == 0
    assert not outside, outside
