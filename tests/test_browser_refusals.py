"""Runs the model refuses only once it is built (a freeze glob or a LoRA target that matches nothing, every parameter
frozen) and torch.compile with mixed precision: in Chromium each keeps the previous result on the page under one
sentence in the form's labels, never the CLI's flags (page errors fail the test)."""

import pytest

from graphviz_core.ui.browser_harness import graph_frame
from tests.conftest import LAPTOP, both_sizes, captured, choose, idle

pytestmark = pytest.mark.browser

KEPT = "The result shown is still that of the previous config."


def _sidebar(page):
    return page.locator('[data-testid="stSidebar"]')


def _refused(page, start: str) -> str:
    """The refusal shown beside the results (the main column's error), once it names `start`."""
    alert = page.locator('[data-testid="stMain"] [data-testid="stAlert"]').filter(has_text=start)
    alert.first.wait_for(timeout=120_000)
    return alert.first.inner_text()


def _run(page) -> None:
    _sidebar(page).get_by_role("button", name="Run backward pass").click()


def _still_shown(page, nodes: int) -> None:
    """The previous config's graph is still on the page (its node count in the frame), and its caption line."""
    graph_frame(page, nodes, timeout_s=60)
    assert page.get_by_text("Loss ").count() >= 1


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_refused_runs_keep_the_previous_result_and_use_the_form_labels(page, streamlit_url, tmp_path):
    nodes = captured("gpt2-tiny").summary.nodes
    page.goto(f"{streamlit_url}/?preset=gpt2-tiny")
    graph_frame(page, nodes, timeout_s=120)
    freeze = _sidebar(page).get_by_role("textbox", name="Freeze parameters (glob)")

    # a glob matching no parameter: refused when the model is built, then the form goes back to gpt2-tiny
    freeze.fill("[")
    _run(page)
    text = _refused(page, "matches no parameter")
    assert "Not run: “Freeze parameters (glob)” '[' matches no parameter" in text and KEPT in text, text
    assert "--" not in text, text
    _still_shown(page, nodes)
    both_sizes(page, tmp_path / "refused-freeze", full_page=False)

    # every parameter frozen: a sentence (no traceback), the result kept
    freeze.fill("*")
    _run(page)
    text = _refused(page, "leaves no parameter training")
    assert text.startswith("Not run: “Freeze parameters (glob)” '*' leaves no parameter training") and KEPT in text
    _still_shown(page, nodes)
    freeze.fill("")

    # torch.compile with autocast: refused at Run, before anything compiles, in the form's words
    _sidebar(page).locator("label").filter(has_text="torch.compile").click()
    choose(page, _sidebar(page).get_by_role("combobox", name="Mixed precision (autocast)", exact=True), "bfloat16")
    _run(page)
    text = _refused(page, "is not captured")
    assert "“torch.compile” with “Mixed precision (autocast)” is not captured" in text and KEPT in text, text
    assert "--" not in text, text
    _still_shown(page, nodes)
    both_sizes(page, tmp_path / "refused-compile", full_page=False)


def test_an_unknown_lora_target_keeps_the_previous_result(page, streamlit_url, tmp_path):
    nodes = captured("gpt2-tiny").summary.nodes
    page.goto(f"{streamlit_url}/?preset=gpt2-tiny")
    graph_frame(page, nodes, timeout_s=120)
    choose(page, _sidebar(page).get_by_role("combobox", name="Fine-tuning", exact=True), "LoRA (base weights frozen)")
    _sidebar(page).get_by_role("textbox", name="LoRA targets").fill("no_such_layer")
    _run(page)
    text = _refused(page, "matches no module")
    assert "Not run: LoRA target 'no_such_layer' matches no module of this model" in text and KEPT in text, text
    _still_shown(page, nodes)
    both_sizes(page, tmp_path / "refused-lora", full_page=False)


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_compare_keeps_the_previous_pair_when_b_is_refused_once_built(page, streamlit_url, tmp_path):
    page.goto(f"{streamlit_url}/compare")
    page.get_by_text("What changed, and why").wait_for(timeout=120_000)
    idle(page, timeout_ms=120_000)  # the first pair drawn and its run over (a click during it was lost on a loaded run)
    form_b = page.locator('[data-testid="stExpander"]').filter(has_text="Config B:")
    form_b.get_by_text("Config B:").click()
    form_b.get_by_role("textbox", name="Freeze parameters (glob)").fill("nothing_here")
    idle(page)
    form_b.get_by_role("button", name="Use as B").click()
    # said above the comparison (B's form may be shut), in the form's words; the last pair's comparison stays
    notice = page.locator('[data-testid="stAlert"]').filter(has_text="Config B not used:")
    notice.wait_for(timeout=120_000)
    text = notice.inner_text()
    assert "“Freeze parameters (glob)” 'nothing_here' matches no parameter" in text, text
    assert text.endswith("The comparison shown is still that of the previous configs."), text
    page.get_by_text("What changed, and why").wait_for(timeout=60_000)
    notice.scroll_into_view_if_needed()
    both_sizes(page, tmp_path / "refused-compare", full_page=False)
