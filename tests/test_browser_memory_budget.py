"""The Memory tab's "Will it fit?" budget in Chromium: a card's budget shows the figure the search button names, and a
typed budget out of range (0, -1, 99,999,999 GiB) gets a sentence and no search, where Streamlit's own bounds kept the
last valid value under a red mark (page errors fail the test)."""

import pytest

from tests.conftest import LAPTOP, both_sizes, choose

pytestmark = pytest.mark.browser


def _main(page):
    return page.locator('[data-testid="stMain"]')


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_the_budget_field_agrees_with_the_button_and_refuses_out_of_range(page, streamlit_url, tmp_path):
    page.goto(f"{streamlit_url}/?preset=gpt2-tiny&tab=Memory")
    # the default card: nvidia-smi's 81,559 MiB for an H100 80GB = 79.65 GiB, shown as the button rounds it
    button = _main(page).get_by_role("button", name="Find the largest batch and seq within 79.6 GiB")
    button.wait_for(timeout=120_000)
    field = _main(page).get_by_role("spinbutton", name="Budget (GiB)")
    assert field.input_value() == "79.6" and field.is_disabled()
    field.scroll_into_view_if_needed()
    both_sizes(page, tmp_path / "budget-card", full_page=False)

    choose(page, _main(page).get_by_role("combobox", name="Memory budget", exact=True), "Custom (GiB)")
    field = _main(page).get_by_role("spinbutton", name="Budget (GiB)")
    field.wait_for(timeout=30_000)
    for typed, shown in (("0", "0.00"), ("-1", "-1.00"), ("99999999", "99,999,999.00")):
        field.fill(typed)
        field.press("Enter")
        sentence = f"Budget (GiB) must be between 0.01 and 1,000,000 GiB; got {shown}. Nothing is searched until it is."
        _main(page).get_by_text(sentence).wait_for(timeout=30_000)
        assert not _main(page).get_by_role("button", name="Find the largest batch").count()  # no search with it
    field.scroll_into_view_if_needed()
    both_sizes(page, tmp_path / "budget-refused", full_page=False)
    field.fill("40")
    field.press("Enter")
    _main(page).get_by_role("button", name="Find the largest batch and seq within 40.0 GiB").wait_for(timeout=30_000)
