"""The toy-expression page in a real browser: Play steps through backward on its own and stops."""

import re
import time

import pytest

from graphviz_core.ui.browser_harness import graph_frame

pytestmark = pytest.mark.browser

STEP = re.compile(r"Step (\d+) of (\d+)")


def shown_step(page) -> tuple[int, int]:
    """(k, n) from the headline "Step k of n", or (0, n) before the first step ("n backward steps to go")."""
    text = page.locator('[data-testid="stMarkdownContainer"]').filter(has_text="Forward:").first.inner_text()
    if match := STEP.search(text):
        return int(match[1]), int(match[2])
    return 0, int(re.search(r"(\d+) backward steps to go", text)[1])


def wait_for_step(page, wanted: int, timeout_s: float) -> list[int]:
    """Poll the headline until it reads step `wanted`; every step seen on the way, in order."""
    seen: list[int] = []
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            k, _ = shown_step(page)
        except Exception:  # noqa: BLE001 - the fragment is being redrawn
            page.wait_for_timeout(100)
            continue
        if not seen or seen[-1] != k:
            seen.append(k)
        if k == wanted:
            return seen
        page.wait_for_timeout(100)
    raise AssertionError(f"the headline never read step {wanted} within {timeout_s:g} s; seen {seen}")


def frames_sent(page) -> list[float]:
    """A list that fills with the time of every websocket message the page sends to the Streamlit server
    (a fragment tick is one rerun request)."""
    sent: list[float] = []
    page.on("websocket", lambda ws: ws.on("framesent", lambda _payload: sent.append(time.time())))
    return sent


def test_play_steps_to_the_end_then_stops(page, streamlit_url):
    # issue 12 item 2: Play turned into Pause, the page stayed at "Step 1 of 6" and the browser sent nothing more.
    sent = frames_sent(page)
    page.goto(f"{streamlit_url}/toy_expressions")
    graph_frame(page, 6)  # "Transformer Math"'s (a*b + c)**2: L, e, d, a, b, c
    assert shown_step(page) == (0, 6)  # L, e, d run, and a, b, c accumulate: 6 autograd nodes
    page.get_by_role("button", name="▶ Play").click()
    # one step per 0.9 s: 6 steps take about 5.4 s; 30 s leaves room for a slow shared machine
    seen = wait_for_step(page, 6, timeout_s=30)
    assert seen == sorted(seen) and seen[-1] == 6 and len(seen) >= 3, seen  # it walked forward, not jumped
    ticks = len(sent)
    page.get_by_role("button", name="▶ Play").wait_for(timeout=10_000)  # Pause turned back into Play at the end
    page.wait_for_timeout(1500)  # the next tick (0.9 s) stops the timer with a full run; let it settle
    quiet_from = time.time()
    page.wait_for_timeout(2500)  # nearly three ticks: a timer still running would ask the server to rerun
    assert shown_step(page) == (6, 6)
    assert [t for t in sent if t > quiet_from] == []  # stopped: the browser asks for nothing more
    assert ticks >= 5, ticks  # while playing it did ask: one rerun request per tick (the detector works)
    assert page.get_by_text("Final gradients").count() == 1


def test_pause_stops_the_steps_where_they_are(page, streamlit_url):
    sent = frames_sent(page)
    page.goto(f"{streamlit_url}/toy_expressions")
    graph_frame(page, 6)
    page.get_by_role("button", name="▶ Play").click()
    wait_for_step(page, 2, timeout_s=30)
    page.get_by_role("button", name="❚❚ Pause").click()
    page.get_by_role("button", name="▶ Play").wait_for(timeout=10_000)
    page.wait_for_timeout(500)  # let the full run that stops the timer settle
    paused_at, _ = shown_step(page)
    assert 2 <= paused_at < 6
    quiet_from = time.time()
    page.wait_for_timeout(2500)  # nearly three ticks of the 0.9 s timer
    assert shown_step(page) == (paused_at, 6)
    assert [t for t in sent if t > quiet_from] == []


def test_the_toy_graph_speaks_of_variables_not_parameters_or_residual_adds(page, streamlit_url):
    # issue 12 item 16: the toy graph's + was in the legend as residual_add, and the hint spoke of parameters,
    # ovals as parameters and dashed boxes as collapsed modules; none of those exist in an expression.
    page.goto(f"{streamlit_url}/toy_expressions")
    frame = graph_frame(page, 6)  # (a*b + c)**2: ops L = e**2, e = d + c, d = a*b; variables a, b, c
    legend = frame.locator("#legend").inner_text()
    hint = frame.locator(".hint").first.inner_text()
    assert sorted(legend.split("\n")) == ["arithmetic", "variable"]  # d, e, L are + * **; a, b, c variables
    assert "residual" not in legend and "parameter" not in hint and "module" not in hint
    assert "from L (top) down to the variables" in hint
    # the current step is highlighted, but it is not a search: no "Next match" / "match 1 of 1"
    assert frame.locator("#next-match").count() == 0
    # every legend entry fits its column: none is wider than the legend's half (columns: 2)
    widths = frame.evaluate("Array.from(document.querySelectorAll('#legend li')).map(li => li.scrollWidth)")
    half = frame.evaluate("document.querySelector('#legend').clientWidth / 2")
    assert max(widths) <= half, (widths, half)
    # the preset and the toggles name the idea; the seed is only in their tooltips
    body = page.locator('[data-testid="stMain"]').inner_text()
    assert "seed 00" not in body, [line for line in body.split("\n") if "seed 00" in line]
    assert "Detach a variable" in body and "Run backward twice, no zeroing" in body
    preset = page.get_by_role("combobox", name="Preset").input_value()  # an <input>: not part of inner_text
    assert preset == "chain rule, worked by hand: L = (a·b + c)²"


def test_a_gradient_that_is_not_finite_is_stepped_to_and_its_node_marked(page, streamlit_url):
    # issue 25 item 15: x**0.5 at x = 0 showed only "a gradient is not finite at these values", no stepper and
    # nothing naming the node. L = x ** 0.5 sends 0.5·0^(-0.5) = inf to x: one step, and L is the node.
    page.goto(f"{streamlit_url}/toy_expressions")
    graph_frame(page, 6)
    expression = page.get_by_role("textbox", name="Expression")
    expression.fill("x**0.5")
    expression.press("Enter")
    value = page.get_by_role("spinbutton", name="x", exact=True)
    value.wait_for(timeout=30_000)
    value.fill("0")
    value.press("Enter")
    page.get_by_text("The gradient is not finite from step 1 on").wait_for(timeout=30_000)
    page.get_by_role("button", name="End »").click()
    wait_for_step(page, 1, timeout_s=30)
    assert shown_step(page) == (1, 1)
    frame = graph_frame(page, 2)  # L and x
    node = frame.evaluate("window.network.body.data.nodes.get('L')")
    assert node["label"].endswith("⚠ sends a gradient that is not finite"), node["label"]
    assert node["borderWidth"] == 5 and node["color"]["border"] == "#e6007e"  # highlighted
    edge = frame.evaluate("window.network.body.data.edges.get().map(e => e.label)")
    assert edge == ["inf ⚠ not finite"]
    assert page.get_by_text("Final gradients").count() == 1
