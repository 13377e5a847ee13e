"""The toy-expression page's inputs (AppTest): values kept by name across edits, a preset box that says when the
fields no longer hold its example."""

from pathlib import Path

from streamlit.testing.v1 import AppTest

from graphviz_core.toy.expressions import EXPRESSION_PRESETS
from graphviz_core.ui.expression_view import EDITED

PAGE = str(Path(__file__).resolve().parent.parent / "pages" / "toy_expressions.py")
WORKED, FAN_OUT = list(EXPRESSION_PRESETS)[0], list(EXPRESSION_PRESETS)[2]


def values(at) -> dict[str, float]:
    return {box.label: box.value for box in at.number_input}


def test_values_survive_a_syntax_error_and_the_preset_box_says_when_it_was_edited():
    at = AppTest.from_file(PAGE, default_timeout=60).run()
    assert at.selectbox(key="expr.preset").value == WORKED
    assert values(at) == {"a": 2.0, "b": -3.0, "c": 10.0}  # "Transformer Math"'s worked example
    at.text_input(key="expr.text").set_value("a +* b").run()  # a syntax error: no value boxes drawn
    assert at.error and not values(at)
    assert at.selectbox(key="expr.preset").value == EDITED
    at.text_input(key="expr.text").set_value("(a*b + c)**2").run()  # typed back: the worked example again
    assert values(at) == {"a": 2.0, "b": -3.0, "c": 10.0}
    assert at.selectbox(key="expr.preset").value == WORKED
    at.text_input(key="expr.text").set_value("a*b + d").run()  # c leaves, d is new: a and b keep theirs
    assert values(at) == {"a": 2.0, "b": -3.0, "d": 1.0}
    assert at.selectbox(key="expr.preset").value == EDITED
    at.text_input(key="expr.text").set_value("(a*b + c)**2").run()
    at.number_input(key="expr.var.a").set_value(5.0).run()  # the same expression, another value: edited too
    assert at.selectbox(key="expr.preset").value == EDITED
    at.selectbox(key="expr.preset").set_value(WORKED).run()  # picking the example again loads it
    assert values(at) == {"a": 2.0, "b": -3.0, "c": 10.0}
    at.selectbox(key="expr.preset").set_value(FAN_OUT).run()
    assert (at.text_input(key="expr.text").value, values(at)) == ("a*b + a**2", {"a": 3.0, "b": -2.0})
    assert not at.exception


def test_the_page_prints_zero_as_0_not_minus_0():
    # issue 25 item 15: relu(a)*relu(-a) at a = 0 is -0.0 (relu(-0.0) keeps the sign); the headline read
    # "L = -0." and the step table "1 × -0"
    at = AppTest.from_file(PAGE, default_timeout=60).run()
    at.text_input(key="expr.text").set_value("relu(a)*relu(-a)").run()
    at.number_input(key="expr.var.a").set_value(0.0).run()
    at.button[3].click().run()  # End »
    assert not at.exception
    headline = next(m.value for m in at.markdown if "Forward:" in m.value)
    assert headline.startswith("**Forward:** L = 0. **Step 5 of 5:**"), headline  # L, f, e, d, a: 5 nodes
    table = at.dataframe[0].value
    assert "dL/dL × dL/dd = 1 × 0" in list(table["computation"])
    assert not any("-0" in cell for cell in [*table["computation"], *table["value"]])
