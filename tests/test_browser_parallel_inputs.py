"""Beyond one GPU in Chromium, as a newcomer meets it: numbers out of a field's range are refused with a sentence naming
the field (never simulated with the previous value), a layout the model cannot take keeps the previous result on
screen, the refusals name strategies as the Strategy box does, and the captions speak of the strategy on screen (DDP,
tensor parallel, a pipeline), clicked at a laptop's size and photographed at a desktop's too (page errors fail)."""

import pytest

from tests.conftest import LAPTOP, both_sizes, choose, idle, open_tab, submit

pytestmark = pytest.mark.browser

# Whether the text in an <input> or a label runs past its box (cut off, or scrolled inside it).
CUT = "e => e.scrollWidth > e.clientWidth"


def _alert(page, text: str):
    alert = page.locator('[data-testid="stMain"] [data-testid="stAlert"]').filter(has_text=text)
    alert.first.wait_for(timeout=120_000)
    return alert.first.inner_text()


def _simulate(page) -> None:
    page.get_by_role("button", name="Simulate ranks").click()


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_out_of_range_numbers_and_refused_layouts_keep_the_last_result(page, streamlit_url, tmp_path):
    page.goto(f"{streamlit_url}/parallel")  # gpt2-tiny, FSDP over 8 ranks
    page.get_by_text("Rank 0 next to one device").wait_for(timeout=180_000)
    page.get_by_text("pipeline stages and context parallelism over a simulated mesh").wait_for(timeout=10_000)
    per_rank = page.locator('[data-testid="stMetricValue"]').first.inner_text()
    world = page.get_by_role("spinbutton", name="World size (GPUs)")
    for typed, shown in (("1000000", "1,000,000"), ("0", "0"), ("-3", "-3")):
        world.fill(typed)
        _simulate(page)
        text = _alert(page, f"(got {shown})")
        assert "World size (GPUs) must be a whole number from 1 to 4,096" in text, text
        assert "The result shown is still that of the last layout run (gpt2, FSDP over 8 ranks)" in text, text
        assert not world.evaluate(CUT), f"{typed} is cut off in the World size box"
        if typed == "1000000":
            world.scroll_into_view_if_needed()
            both_sizes(page, tmp_path / "world-size", full_page=True)
    assert page.locator('[data-testid="stMetricValue"]').first.inner_text() == per_rank

    # Context parallel on the built-in gpt2: refused with its family's reason, the FSDP result stays.
    world.fill("8")
    page.get_by_role("spinbutton", name="Context parallel (cp)").fill("2")
    _simulate(page)
    text = _alert(page, "context parallel cannot split the tokens of model")
    assert "The result shown is still that of the last layout run (gpt2, FSDP over 8 ranks)" in text, text
    page.get_by_text("Rank 0 next to one device").wait_for(timeout=10_000)
    assert page.locator('[data-testid="stMetricValue"]').first.inner_text() == per_rank
    both_sizes(page, tmp_path / "refused", full_page=True)

    # Context parallel under tensor parallel: the strategies named as the Strategy box shows them.
    page.get_by_role("spinbutton", name="TP degree").fill("8")
    choose(page, page.locator('[data-testid="stSidebar"]').get_by_role("combobox", name="Strategy", exact=True),
           "tensor parallel")
    _simulate(page)
    text = _alert(page, "pick strategy")
    assert 'pick strategy "FSDP", "DDP" or "FSDP × TP (2-D)" (got "tensor parallel")' in text, text
    assert "'tp'" not in text and "fsdp+tp" not in text, text


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_the_captions_speak_of_the_strategy_on_screen(page, streamlit_url, tmp_path):
    def open_layout(query: str, waits_for: str) -> str:
        page.goto(f"{streamlit_url}/parallel?{query}")
        page.get_by_text(waits_for).first.wait_for(timeout=180_000)
        # the heading is drawn mid-run: what follows it (the padding's caption) only once the run has ended (a read
        # taken at the heading once ended there and missed "FSDP2 pads each parameter")
        idle(page, settle_ms=300)
        return page.locator('[data-testid="stMain"]').inner_text()

    shown = open_layout("strategy=ddp&world_size=2", "Rank 0 next to one device")
    assert "DDP (replicate, all-reduce gradients) over 2 ranks" in shown, shown[:2000]
    assert "FSDP2 pads" not in shown and "FSDP as training scripts wrap it" not in shown
    assert "shard" not in shown.split("Memory per rank", 1)[1].lower(), shown  # DDP copies; nothing is sharded
    page.get_by_role("tab", name="Communication in backward").click()
    page.get_by_text("DDP's (torch's replicate, built on FSDP2's hooks) collectives run in hooks").wait_for(
        timeout=10_000)

    shown = open_layout("strategy=tp&world_size=2&tp=2", "Rank 0 next to one device")
    assert "FSDP2 pads" not in shown and "FSDP as training scripts wrap it" not in shown
    page.get_by_role("tab", name="Communication in backward").click()
    panel = page.get_by_role("tabpanel").filter(has_text="autograd nodes")
    panel.get_by_text("tensor parallelism's DTensor conversions").wait_for(timeout=10_000)
    assert "hook" not in panel.inner_text(), panel.inner_text()[:2000]
    panel.locator('[data-testid="stTable"]').filter(has_text="all-reduce").first.wait_for(timeout=30_000)
    both_sizes(page, tmp_path / "tp-communication", full_page=True)

    shown = open_layout("preset=llama-tiny&world_size=4&pp=2&microbatches=2", "Rank 0 next to one device")
    assert "it holds the first pipeline stage" in shown and "symmetric" not in shown, shown[:2000]

    shown = open_layout("preset=llama-tiny", "Rank 0 next to one device")
    assert "symmetric" in shown and "FSDP2 pads each parameter" in shown
    open_tab(page, "Plan")
    form = page.locator('[data-testid="stForm"]').filter(has_text="GPUs in all")
    label = form.get_by_text("Context parallel with pipeline stages too", exact=True)
    assert not label.evaluate(CUT), "the checkbox's label is cut off"
    for field, typed, sentence in (
        ("GPUs in all", "0", "GPUs in all must be a whole number from 1 to 4,096 (got 0)."),
        ("Global batch (sequences per optimizer step)", "0",
         "Global batch (sequences per optimizer step) must be a whole number from 1 to 1,048,576 (got 0)."),
        # the planner's ranges (planner.RATES): 1e6 to 1e21 FLOP/s, 1e3 to 1e15 B/s, in the boxes' units
        ("GPU TFLOP/s (dense)", "0", "GPU TFLOP/s (dense) takes a rate from 1e-06 to 1e+09 TFLOP/s, got 0.0."),
        ("Network GB/s per GPU", "0", "Network GB/s per GPU takes a rate from 1e-06 to 1e+06 GB/s, got 0.0."),
    ):
        box = form.get_by_role("spinbutton", name=field)
        before = box.input_value()
        box.fill(typed)
        alert = page.locator('[data-testid="stMain"] [data-testid="stAlert"]').filter(has_text=sentence)
        submit(page, form.get_by_role("button", name="Plan the layouts"), alert)
        assert sentence in _alert(page, sentence)
        assert page.locator('[data-testid="stProgress"]').count() == 0  # nothing planned
        box.fill(before)
    page.locator('[data-testid="stAlert"]').last.scroll_into_view_if_needed()
    both_sizes(page, tmp_path / "plan-refused", full_page=True)
