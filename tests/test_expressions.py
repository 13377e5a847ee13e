"""Toy expressions: "Transformer Math"'s numbers exactly, real autograd, finite differences, and a parser that
never executes anything."""

import math
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphviz_core.toy.expressions import (
    EXPRESSION_PRESETS,
    FUNCTIONS,
    parse_expression,
    step_table,
    trace_expression,
    trace_graph,
)


def test_seed_003_walkthrough_exactly():
    trace = trace_expression("(a*b + c)**2", {"a": 2, "b": -3, "c": 10})
    # forward: d = a*b = 2*(-3) = -6; e = d + c = -6 + 10 = 4; L = e**2 = 16
    assert [(i.name, i.value) for i in trace.intermediates] == [("d", -6.0), ("e", 4.0), ("L", 16.0)]
    assert trace.value == 16.0
    # backward: dL/de = 2e = 8; dL/dd = dL/de * 1 = 8; dL/dc = 8 * 1 = 8; dL/da = dL/dd * b = 8*(-3) = -24;
    # dL/db = dL/dd * a = 8*2 = 16
    upstream = {s.node: s.upstream for s in trace.steps if s.op != "AccumulateGrad"}
    assert upstream == {"L": 1.0, "e": 8.0, "d": 8.0}
    assert trace.grads == {"a": -24.0, "b": 16.0, "c": 8.0}
    # The order autograd ran the nodes: L, e, then c's accumulation before d (its edge came first), a, b.
    assert [(s.node, s.op) for s in trace.steps] == [
        ("L", "PowBackward1"), ("e", "AddBackward0"), ("c", "AccumulateGrad"), ("d", "MulBackward0"),
        ("a", "AccumulateGrad"), ("b", "AccumulateGrad")]
    d_step = next(s for s in trace.steps if s.node == "d")
    assert [(e.to, e.local, e.grad) for e in d_step.edges] == [("a", -3.0, -24.0), ("b", 2.0, 16.0)]


def test_single_neuron_against_a_hand_derivation():
    # L = (w*x + b - y)**2, w=3, x=2, b=1, y=4: z = 6, a = 7, e = a - y = 3, L = 9; dL/de = 2e = 6;
    # dL/dw = 6 * x = 12, dL/dx = 6 * w = 18, dL/db = 6, dL/dy = -6
    trace = trace_expression("(w*x + b - y)**2", {"w": 3, "x": 2, "b": 1, "y": 4})
    assert trace.value == 9.0
    assert trace.grads == {"w": 12.0, "x": 18.0, "b": 6.0, "y": -6.0}


@pytest.mark.parametrize("name", list(EXPRESSION_PRESETS))
def test_every_preset_matches_torch_and_finite_differences(name):
    text, values = EXPRESSION_PRESETS[name]
    trace = trace_expression(text, values)
    # torch directly, written out by hand for each preset
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in values.items()}
    direct = {
        "(a*b + c)**2": lambda: (t["a"] * t["b"] + t["c"]) ** 2,
        "(w*x + b - y)**2": lambda: (t["w"] * t["x"] + t["b"] - t["y"]) ** 2,
        "a*b + a**2": lambda: t["a"] * t["b"] + t["a"] ** 2,
        "sigmoid(w*x) * tanh(x)": lambda: torch.sigmoid(t["w"] * t["x"]) * torch.tanh(t["x"]),
    }[text]()
    direct.backward()
    for var in values:
        assert trace.grads[var] == t[var].grad.item()
        assert trace.numerical_grads[var] == pytest.approx(trace.grads[var], rel=1e-6, abs=1e-9)


def test_fan_out_gradient_is_the_sum_over_paths():
    # L = a*b + a**2 at a=3, b=-2: via the product dL/da = b = -2, via the square 2a = 6; sum 4
    trace = trace_expression("a*b + a**2", {"a": 3, "b": -2})
    into_a = sorted(e.grad for s in trace.steps for e in s.edges if e.to == "a")
    assert into_a == [-2.0, 6.0]
    assert trace.grads["a"] == sum(into_a) == 4.0
    rows = step_table(trace, len(trace.steps))
    # rows are numbered from 1 like the stepper's "Step k of 6": a's accumulation is the 4th node autograd runs
    # (L = d + e, e = a**2, d = a*b, then a), so its row reads 4, not its 0-based index 3
    assert {"step": "4", "gradient": "a.grad", "computation": "a.grad += 6 + (-2) (sum over 2 paths)", "value": "4"} in rows


def test_step_table_numbers_rows_like_the_stepper_headline():
    # issue 12 item 16: the headline says "Step 1 of 6" after one step; the table's first step row read 0
    trace = trace_expression("(a*b + c)**2", {"a": 2, "b": -3, "c": 10})
    rows = step_table(trace, 1)  # after step 1: L = e**2 has run, one edge L -> e
    assert [r["step"] for r in rows] == ["", "1"]
    assert [r["step"] for r in step_table(trace, len(trace.steps))][-1] == str(len(trace.steps)) == "6"


def test_second_backward_pass_sentences_count_only_that_passs_paths():
    # issue 12 item 4: a*b + a**2 at a=3, b=-2, backward twice without zeroing. Each pass sends a 6 (via a**2,
    # 2a = 6) and -2 (via a*b, b = -2) into a, and 3 (a) into b. Pass 2 used to read "6 + (-2) + 6 + (-2) (sum
    # over 4 paths)" and "3 + 3 (sum over 2 paths)": the sums mixed both passes' paths.
    trace = trace_expression("a*b + a**2", {"a": 3, "b": -2}, backward_passes=2)
    rows = step_table(trace, len(trace.steps))
    grads = [(r["pass"], r["computation"], r["value"]) for r in rows if r["gradient"] in ("a.grad", "b.grad")]
    assert grads == [
        ("1", "a.grad += 6 + (-2) (sum over 2 paths)", "4"),  # 6 - 2 = 4
        ("1", "b.grad += 3", "3"),
        ("2", "a.grad += 6 + (-2) (sum over 2 paths); .grad was 4, so 4 + 4", "8"),  # 4 + (6 - 2) = 8
        ("2", "b.grad += 3; .grad was 3, so 3 + 3", "6"),  # 3 + 3 = 6
    ]
    # each pass opens with its own dL/dL = 1
    assert [r["pass"] for r in rows if r["gradient"] == "dL/dL"] == ["1", "2"]
    assert [s.backward_pass for s in trace.steps] == [1] * 5 + [2] * 5  # L, e, d, a, b per pass


def test_detach_removes_the_path_and_leaves_grad_none():
    trace = trace_expression("(a*b + c)**2", {"a": 2, "b": -3, "c": 10}, detach=["a"])
    # a is used through a.detach(): the product still multiplies by 2, so b and c keep their gradients
    assert trace.grads == {"a": None, "b": 16.0, "c": 8.0}
    assert all(e.to != "a" for s in trace.steps for e in s.edges)
    assert ("d", "a") not in trace_graph(trace, len(trace.steps)).edges
    assert trace.numerical_grads["a"] == pytest.approx(-24.0, rel=1e-6)  # L still depends on a


def test_two_backward_passes_without_zeroing_accumulate():
    trace = trace_expression("(a*b + c)**2", {"a": 2, "b": -3, "c": 10}, backward_passes=2)
    # pass 1: -24, 16, 8; pass 2 adds the same again: .grad += grad -> -48, 32, 16
    assert trace.grads_after_each_pass == ({"a": -24.0, "b": 16.0, "c": 8.0}, {"a": -48.0, "b": 32.0, "c": 16.0})
    second_a = [s for s in trace.steps if s.node == "a"][1]
    assert (second_a.upstream, second_a.accumulated) == (-24.0, -48.0)


def test_graph_reveals_gradients_step_by_step():
    trace = trace_expression("(a*b + c)**2", {"a": 2, "b": -3, "c": 10})
    before = trace_graph(trace, 0)
    assert all(label == "" for _, _, label in before.edges(data="label"))
    after_two = trace_graph(trace, 2)  # L and e have run: L->e carries 8, e->d and e->c carry 8
    assert {(u, v): lab for u, v, lab in after_two.edges(data="label")} == {
        ("L", "e"): "8", ("e", "d"): "8", ("e", "c"): "8", ("d", "a"): "", ("d", "b"): ""}


# ---- the parser ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("__import__('os').system('x')", "only the functions"),
        ("__import__('os')", "unknown function '__import__'"),
        ("a.__class__", "attribute access"),
        ("(lambda: 1)()", "only the functions"),
        ("lambda x: x", "lambda functions cannot be used"),
        ("[x for x in a]", "list comprehensions cannot be used"),
        ("open('f')", "unknown function 'open'"),
        ("a ** 1e400", "too large"),
        ("a +", "syntax error"),
        ("exp(a, b)", "takes exactly one argument"),
        ("a // b", r"operator // \(floor division\) cannot be used \(you typed 'a // b' at column 1\)"),
        ("__a + 1", "the name '__a'"),
        ("'text'", "only numbers"),
        ("a" * 501, "the limit is 500"),
        ("+".join(["a"] * 102), "more than 100 operations"),  # 102 terms = 101 additions
        ("", "empty"),
    ],
)
def test_hostile_or_bad_input_gets_one_sentence(text, message):
    with pytest.raises(ValueError, match=message):
        trace_expression(text, {"a": 1.0, "b": 2.0, "x": 1.0})


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("a if b else a", "conditional expressions (x if c else y) cannot be used (you typed 'a if b else a' at column 1)"),
        ("a[0] + b", "indexing (a[...]) cannot be used (you typed 'a[0]' at column 1)"),
        ("b * (a @ b)", "the operator @ (matrix multiplication) cannot be used (you typed 'a @ b' at column 6)"),
        ("a ^ 2", "the operator ^ (for a power, write **) cannot be used"),
        ("a < b", "comparisons (<, ==, ...) cannot be used"),
        ("not a", "the operator not cannot be used"),
    ],
)
def test_parser_errors_say_what_was_typed_not_pythons_ast_class(text, words):
    # issue 12 item 16: these used to read "IfExp at column 1", "Subscript ...", "the operator MatMult ..."
    with pytest.raises(ValueError) as caught:
        parse_expression(text)
    message = str(caught.value)
    assert words in message
    assert not any(cls in message for cls in ("IfExp", "Subscript", "MatMult", "BitXor", "Compare", "UnaryOp", "Not"))


def test_a_variable_named_L_is_refused_because_L_names_the_result():
    # issue 12 item 5: "L*2 + d" with L=3 made the root L and the variable L one node (a cycle, "L.grad += dL/dL")
    with pytest.raises(ValueError, match="the name L at column 1 is kept for the result"):
        trace_expression("L*2 + d", {"L": 3, "d": 1})
    assert parse_expression("+l") == parse_expression("l")  # lower-case l is a variable; unary plus is identity


def test_intermediate_names_skip_the_variables_names():
    # 23 variables d..z (no l) use up every spare letter; t1 is also a variable, so the first intermediate is t2.
    letters = [c for c in "defghijkmnopqrstuvwxyz"]
    names = letters + ["t1"]
    trace = trace_expression("(" + "+".join(names) + ")*2", {n: 1.0 for n in names})
    intermediate_names = [i.name for i in trace.intermediates]
    assert intermediate_names[0] == "t2" and intermediate_names[-1] == "L"
    assert not set(intermediate_names) & set(names)


def test_missing_values_overflow_and_nan_are_sentences():
    with pytest.raises(ValueError, match="give a value for c"):
        trace_expression("a + c", {"a": 1})
    with pytest.raises(ValueError, match="evaluates to inf"):
        trace_expression("exp(a)**a", {"a": 50})
    with pytest.raises(ValueError, match="evaluates to nan"):
        trace_expression("log(a)", {"a": -1})


NUMBERS = st.floats(min_value=-5, max_value=5, allow_nan=False).map(lambda v: f"{v:.3g}")
LEAVES = st.one_of(st.sampled_from(["a", "b", "c"]), NUMBERS)


def _expressions():
    return st.recursive(
        LEAVES,
        lambda inner: st.one_of(
            st.tuples(inner, st.sampled_from(["+", "-", "*", "/", "**"]), inner).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
            inner.map(lambda e: f"-({e})"),
            st.tuples(st.sampled_from(FUNCTIONS), inner).map(lambda t: f"{t[0]}({t[1]})"),
        ),
        max_leaves=12,
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_expressions(), st.floats(-3, 3), st.floats(-3, 3), st.floats(-3, 3))
def test_generated_expressions_parse_and_trace_or_say_why(text, a, b, c):
    parse_expression(text)  # well-formed: must parse
    try:
        trace = trace_expression(text, {"a": a, "b": b, "c": c})
    except ValueError as exc:  # overflow / NaN / division by zero at these values: a sentence, not a crash
        assert str(exc)
        return
    assert math.isfinite(trace.value)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_arbitrary_text_never_escapes_the_parser(text):
    started = time.perf_counter()
    try:
        parse_expression(text)
    except ValueError:
        pass
    assert time.perf_counter() - started < 1.0


def test_deep_nesting_and_long_input_are_handled_promptly():
    started = time.perf_counter()
    assert parse_expression("(" * 100 + "a" + ")" * 100).name == "a"  # parentheses make no nodes
    for text, message in [("(" * 240 + "a" + ")" * 240, "nested too deeply|syntax error"),
                          ("-" * 499 + "a", "more than 100 operations"),
                          ("a" + "**a" * 150, "more than 100 operations"),
                          ("9" * 499, "too large")]:
        with pytest.raises(ValueError, match=message):
            parse_expression(text)
    assert time.perf_counter() - started < 2.0


@pytest.mark.parametrize("text", ["2*3", "x*x*x"])
def test_toy_page_with_no_backward_steps_says_so_instead_of_a_traceback(text):
    # "2*3" has no variables; "x*x*x" with x detached has no path: autograd runs 0 nodes, so there is nothing to step.
    from streamlit.testing.v1 import AppTest

    page = str(Path(__file__).resolve().parent.parent / "pages" / "toy_expressions.py")
    at = AppTest.from_file(page, default_timeout=120).run()
    at.text_input(key="expr.text").set_value(text).run()
    if text == "x*x*x":
        at.multiselect(key="expr.detach").set_value(["x"]).run()
    assert not at.exception, at.exception
    assert any("no backward steps" in m.value for m in at.markdown), [m.value for m in at.markdown]



def test_the_stepper_buttons_are_off_where_there_is_no_step_to_go():
    """At the last step Next and End stayed enabled and did nothing (issue 33 item 12); at step 0 Start and
    Previous did the same."""
    from streamlit.testing.v1 import AppTest

    page = str(Path(__file__).resolve().parent.parent / "pages" / "toy_expressions.py")
    at = AppTest.from_file(page, default_timeout=120).run()

    def disabled(at) -> dict[str, bool]:
        return {b.label: b.disabled for b in at.button if b.label in ("« Start", "‹ Previous", "Next ›", "End »")}

    assert disabled(at) == {"« Start": True, "‹ Previous": True, "Next ›": False, "End »": False}  # step 0 of 6
    at = next(b for b in at.button if b.label == "End »").click().run()
    assert at.slider(key="expr.step").value == 6  # (a*b + c)**2: 6 autograd nodes
    assert disabled(at) == {"« Start": False, "‹ Previous": False, "Next ›": True, "End »": True}
    at = next(b for b in at.button if b.label == "‹ Previous").click().run()
    assert at.slider(key="expr.step").value == 5 and not any(disabled(at).values())

# ---- finite differences at kinks and domain edges (issue 12 items 11 and 20) -------------------------------


def test_a_kink_is_named_with_the_side_autograd_takes():
    # sigmoid(x) + relu(x) at x = 0: sigmoid'(0) = 1/4; relu's slope is 0 on the left and 1 on the right, so L's
    # slopes are 0.25 (left) and 1.25 (right); autograd takes relu'(0) = 0 -> 0.25; the central difference
    # averages them: (0.25 + 1.25) / 2 = 0.75. This used to be shown as a bare |difference| of 0.5.
    trace = trace_expression("sigmoid(x) + relu(x)", {"x": 0.0})
    fd = trace.finite_differences["x"]
    assert trace.grads["x"] == 0.25
    assert fd.kink and fd.value == pytest.approx(0.75, abs=1e-6)
    assert (fd.left, fd.right) == (pytest.approx(0.25, abs=1e-6), pytest.approx(1.25, abs=1e-6))
    assert "kink at x = 0" in fd.note and "slope is 0.25 from the left and 1.25 from the right" in fd.note
    assert "Autograd reports 0.25, the left-hand slope" in fd.note and "relu'(0) = 0" in fd.note


def test_kinks_are_found_from_the_two_sides_not_from_the_function_name():
    # relu(a)*b at a=0, b=-3: slopes 0 (left) and -3 (right); autograd 0 = the left side
    fd = trace_expression("relu(a)*b", {"a": 0.0, "b": -3.0}).finite_differences["a"]
    assert fd.kink and (fd.left, fd.right) == (pytest.approx(0.0, abs=1e-6), pytest.approx(-3.0, abs=1e-6))
    # abs(a) at 0: slopes -1 and 1, autograd sign(0) = 0 lies between them
    fd = trace_expression("abs(a)", {"a": 0.0}).finite_differences["a"]
    assert fd.kink and "Autograd reports 0, a value between the two sides" in fd.note
    # relu spelled (a + abs(a)) / 2: slopes 0 and 1; autograd (1 + sign(0)) / 2 = 0.5, between them
    fd = trace_expression("(a + abs(a)) / 2", {"a": 0.0}).finite_differences["a"]
    assert fd.kink and (fd.left, fd.right) == (pytest.approx(0.0, abs=1e-6), pytest.approx(1.0, abs=1e-6))
    assert "Autograd reports 0.5, a value between the two sides" in fd.note
    # smooth points are not kinks: |a| away from 0, and a**2 + a at 0 (slope 1 on both sides)
    assert trace_expression("sqrt(a*a)", {"a": 0.5}).finite_differences["a"].kink is False
    assert trace_expression("a**2 + a", {"a": 0.0}).finite_differences["a"].kink is False
    # relu at a = 1e-7 is smooth (slope 1); a step of 1e-6 would cross its kink at 0, so the step shrinks
    fd = trace_expression("relu(a)", {"a": 1e-7}).finite_differences["a"]
    assert not fd.kink and fd.value == pytest.approx(1.0, rel=1e-9) and fd.step <= 1e-7  # 1e-6 -> 1e-7


@pytest.mark.parametrize(("text", "exact"), [
    ("sqrt(a)", 1 / (2 * math.sqrt(1e-7))),  # 1/(2·sqrt(1e-7)) = 1581.14
    ("log(a)", 1 / 1e-7),  # 1/a = 1e7
])
def test_near_a_domain_edge_the_step_stays_inside_the_domain(text, exact):
    # a = 1e-7: a - 1e-6 < 0, where sqrt and log are NaN; the central difference used to be NaN
    trace = trace_expression(text, {"a": 1e-7})
    fd = trace.finite_differences["a"]
    assert fd.value == pytest.approx(exact, rel=1e-6) and fd.step <= 1e-8
    assert "leaves the domain" in fd.note and trace.grads["a"] == pytest.approx(exact, rel=1e-12)


def test_no_finite_step_says_so():
    from graphviz_core.toy.expressions import finite_difference

    # f is finite only at x itself (a made-up function: the expression language cannot build one)
    fd = finite_difference(lambda x: 0.0 if x == 1.0 else math.nan, 1.0, "x")
    assert (fd.value, fd.method) == (None, "none") and "no finite difference" in fd.note


def test_expr_json_is_valid_json_with_nan_as_null(capsys):
    import json

    from graphviz_core.cli import main

    # a**b at a=0, b=2: dL/db's local derivative a^b·ln a is 0·(-inf) as floats, printed as "local": NaN before;
    # its limit (and PyTorch's gradient) is 0
    assert main(["expr", "a**b", "a=0", "b=2"]) == 0
    text = capsys.readouterr().out
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    pow_step = next(s for s in data["steps"] if s["op"] == "PowBackward1")
    assert [e["local"] for e in pow_step["edges"]] == [0.0, 0.0]  # b·a^(b-1) = 2·0 = 0; the limit 0
    # sqrt(a) at a=1e-7: the numerical gradient was NaN
    assert main(["expr", "sqrt(a)", "a=1e-7"]) == 0
    data = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert data["numerical_grads"]["a"] == pytest.approx(1581.1388, rel=1e-6)  # 1/(2·sqrt(1e-7))
    assert any("leaves the domain" in n for n in data["notes"])


def test_non_finite_floats_become_null_with_a_note():
    from graphviz_core.toy.expressions import Trace

    trace = trace_expression("a*b", {"a": 2.0, "b": 3.0})
    broken = Trace(**{**trace.__dict__, "numerical_grads": {"a": math.nan, "b": math.inf}})
    data = broken.to_json_dict()
    assert data["numerical_grads"] == {"a": None, "b": None}
    assert "numerical_grads.a: nan as a float (written as null)" in data["notes"]


def test_toy_page_names_the_kink_in_the_final_gradients():
    # issue 12 item 11 on the page: the final check shows a warning, not just |difference| 0.5
    from streamlit.testing.v1 import AppTest

    page = str(Path(__file__).resolve().parent.parent / "pages" / "toy_expressions.py")
    at = AppTest.from_file(page, default_timeout=120).run()
    at.text_input(key="expr.text").set_value("sigmoid(x) + relu(x)").run()
    at.number_input(key="expr.var.x").set_value(0.0).run()
    at.button[3].click().run()  # End »: the final gradients show at the last step
    assert not at.exception, at.exception
    warnings = [w.value.replace("\\", "") for w in at.warning]  # the note is Markdown-escaped
    assert any("kink at x = 0" in w and "left-hand slope" in w for w in warnings), warnings


def test_toy_graph_categories_are_arithmetic_functions_and_variables():
    # issue 12 item 16: category_of("AddBackward0") is residual_add, which an expression's + never is
    trace = trace_expression("sigmoid(a*b) + c", {"a": 1.0, "b": 2.0, "c": 3.0})
    graph = trace_graph(trace, 0)
    # d = a*b and L = e + c are arithmetic, e = sigmoid(d) a function, a, b, c variables
    assert {n: graph.nodes[n]["category"] for n in graph} == {
        "L": "elementwise", "e": "activation", "d": "elementwise",
        "a": "accumulate_grad", "b": "accumulate_grad", "c": "accumulate_grad"}


def test_toy_page_checks_one_pass_against_the_finite_difference_when_backward_ran_twice():
    # a*b + a**2 at a=3, b=-2, two passes: .grad a = 2 * 4 = 8, the derivative (finite difference) is 4; the
    # check compares pass 1's 4 with it (|4 - 4| ~ 1e-9), not 8 (which read as a difference of 4)
    from streamlit.testing.v1 import AppTest

    page = str(Path(__file__).resolve().parent.parent / "pages" / "toy_expressions.py")
    at = AppTest.from_file(page, default_timeout=120).run()
    at.text_input(key="expr.text").set_value("a*b + a**2").run()
    at.number_input(key="expr.var.a").set_value(3.0).run()
    at.number_input(key="expr.var.b").set_value(-2.0).run()
    at.toggle(key="expr.twice").set_value(True).run()
    at.button[3].click().run()  # End »
    assert not at.exception, at.exception
    final = at.dataframe[-1].value
    row = final[final["variable"] == "a"].iloc[0]
    assert row["backprop (autograd)"] == "8" and float(row["numerical (finite difference)"]) == pytest.approx(4.0)
    assert float(row["|pass 1 − numerical|"]) < 1e-6


def test_a_negative_base_to_a_fractional_power_traces_up_to_the_node_that_made_nan():
    # Found by the generated test: (b ** a) ** 0 at b = -1, a = 0.5. Forward: d = b ** a = (-1)^0.5 = nan (real
    # floats), L = d ** 0 = 1. Backward: L's step sends 0·d^(-1) = 0 (torch's pow by exponent 0), then d = b ** a
    # sends a·b^(a-1) = 0.5·(-1)^(-0.5) = nan to b (Python's float maths makes it complex: the local is shown as nan)
    # and b^a·ln b = nan to a. The trace stops at d, step 2, and names it.
    trace = trace_expression("(b ** a) ** 0", {"a": 0.5, "b": -1.0})
    assert [(s.node, s.op) for s in trace.steps] == [("L", "PowBackward1"), ("d", "PowBackward1")]
    assert trace.steps[0].edges[0].grad == 0.0  # L sends 0 to d: finite
    assert trace.non_finite_step == 1 and trace.non_finite_node(2) == "d" and trace.non_finite_node(1) is None
    assert [(e.to, math.isnan(e.grad)) for e in trace.steps[1].edges] == [("b", True), ("a", True)]
    assert trace.value == 1.0  # nan ** 0 = 1
    assert trace.non_finite_sentence.startswith("The gradient is not finite from step 2 on: d = b ** a (PowBackward1) "
                                                "sends nan to b (local derivative 0.5·(-1)^(-0.5)); nan to a")


def test_sqrt_at_zero_traces_up_to_and_through_the_node_with_the_infinite_gradient(capsys):
    # issue 27 item 2 / issue 25 item 15: x**0.5 at x = 0 was "a gradient is not finite at these values", exit 2,
    # no JSON. L = x ** 0.5 = 0; its step sends dL/dx = 0.5·0^(-0.5) = 0.5·inf = inf: step 1 of 1 (x's += is not
    # shown: it only adds the inf).
    import json

    from graphviz_core.cli import main

    trace = trace_expression("x**0.5", {"x": 0.0})
    assert trace.value == 0.0 and len(trace.steps) == 1 and trace.non_finite_step == 0
    assert (trace.steps[0].edges[0].to, trace.steps[0].edges[0].grad) == ("x", math.inf)
    assert trace.grads == {"x": math.inf}
    assert main(["expr", "x**0.5", "x=0", "--format", "json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    data = json.loads(captured.out, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert {"expression", "value", "grads", "numerical_grads", "steps"} <= set(data)
    assert data["value"] == 0.0 and data["grads"] == {"x": None} and data["non_finite_step"] == 0
    assert [(s["node"], s["formula"]) for s in data["steps"]] == [("L", "L = x ** 0.5")]
    edge = data["steps"][0]["edges"][0]
    assert (edge["to"], edge["grad"], edge["local"], edge["local_text"]) == ("x", None, None, "0.5·0^(-0.5)")
    assert "steps[0].edges[0].grad: inf as a float (written as null)" in data["notes"]
    assert ("steps[0]: The gradient is not finite from step 1 on: L = x ** 0.5 (PowBackward1) sends inf to x "
            "(local derivative 0.5·0^(-0.5))") in " ".join(data["notes"])
    # the forward values and the finite difference are all there: sqrt(1e-6)/1e-6 = 1000, one-sided
    assert data["numerical_grads"]["x"] == pytest.approx(1000.0) and data["finite_differences"]["x"]["method"] == "forward"


def test_the_steps_before_the_infinite_gradient_are_kept_and_the_table_and_graph_mark_it():
    # sqrt(x) + y at x = 0, y = 2: L = d + y sends 1 to d and 1 to y (step 1), y.grad += 1 (step 2), then
    # d = sqrt(x) sends 1/(2·sqrt(0)) = inf to x (step 3): three steps, the third marked
    trace = trace_expression("sqrt(x) + y", {"x": 0.0, "y": 2.0})
    assert [s.node for s in trace.steps] == ["L", "y", "d"] and trace.non_finite_step == 2
    rows = step_table(trace, 3)
    assert rows[-1] == {"step": "3", "gradient": "dL/dx (via d)", "computation": "dL/dd × dd/dx = 1 × 1/(2·sqrt(0))",
                        "value": "inf ⚠ not finite"}
    assert not any("not finite" in r["value"] for r in rows[:-1])
    assert "⚠" not in trace_graph(trace, 2).nodes["d"]["label"]  # not before its step
    graph = trace_graph(trace, 3)
    assert graph.nodes["d"]["label"].endswith("⚠ sends a gradient that is not finite")
    assert graph.edges["d", "x"]["label"] == "inf ⚠ not finite" and graph.edges["L", "y"]["label"] == "1"


@pytest.mark.parametrize(("x", "in_formula", "alone"), [
    (2.0, "2", "2"),
    (16.0, "16", "16"),  # an integer without ".0"
    (-2.0, "(-2)", "-2"),  # a negative after an operator in brackets, once
    (0.0, "0", "0"),
    (-0.0, "0", "0"),  # IEEE's signed zero: relu(a)*relu(-a) at a = 0 is -0.0
    (-1e-300 * 1e-300, "0", "0"),  # underflows to -0.0
    (1e-7, "1e-7", "1e-7"),  # Python's :g writes 1e-07
    (1e20, "1e20", "1e20"),  # and 1e+20
    (-2.5e-7, "(-2.5e-7)", "-2.5e-7"),
    (0.1 + 0.2, "0.3", "0.3"),  # six significant digits
    (math.nan, "nan", "nan"),
    (math.inf, "inf", "inf"),
    (-math.inf, "(-inf)", "-inf"),
])
def test_one_number_formatter_for_formulas(x, in_formula, alone):
    from graphviz_core.toy.expressions import number_text

    assert number_text(x, bracket_negative=True) == in_formula
    assert number_text(x) == alone


def test_zero_is_printed_as_0_never_minus_0(capsys):
    # issue 25 item 15: relu(a)*relu(-a) at a = 0: d = relu(0) = 0, e = -a = -0.0, f = relu(-0.0) = -0.0 (torch keeps
    # the sign), L = d * f = -0.0; the page read "L = -0." and the table "1 × -0"
    import json
    import re

    from graphviz_core.cli import main

    trace = trace_expression("relu(a)*relu(-a)", {"a": 0.0})
    minus_zero = re.compile(r"-0(?![.\d])")
    texts = [v for row in step_table(trace, len(trace.steps)) for v in row.values()]
    graph = trace_graph(trace, len(trace.steps))
    texts += [label for _, label in graph.nodes(data="label")] + [label for *_, label in graph.edges(data="label")]
    texts += [cell for _, rows in graph.nodes(data="details") for row in rows for cell in row]
    assert "dL/dL × dL/dd = 1 × 0" in texts
    assert [t for t in texts if minus_zero.search(t)] == []
    assert main(["expr", "relu(a)*relu(-a)", "a=0"]) == 0
    out = capsys.readouterr().out
    assert not minus_zero.search(out), [line for line in out.splitlines() if minus_zero.search(line)]
    data = json.loads(out)
    assert data["value"] == 0.0 and [e["local_text"] for e in data["steps"][0]["edges"]] == ["0", "0"]


def test_a_negative_inside_a_function_gets_one_pair_of_brackets():
    # issue 27 item 8: the page read "1 × 1 - tanh((-2))²". tanh(a) at a = -2: dL/da = 1 - tanh(-2)² = 0.0706508
    trace = trace_expression("tanh(a)", {"a": -2.0})
    assert trace.steps[0].edges[0].local_text == "1 - tanh(-2)²"
    assert step_table(trace, 1)[-1]["computation"] == "dL/dL × dL/da = 1 × 1 - tanh(-2)²"
    assert step_table(trace, 1)[-1]["value"] == "0.0706508"
    # a negative after an operator keeps its one pair: a * b at b = -3 sends b = (-3) to a; -a sends (-1)
    assert trace_expression("a*b", {"a": 2.0, "b": -3.0}).steps[0].edges[0].local_text == "(-3)"
    assert trace_expression("-a", {"a": 2.0}).steps[0].edges[0].local_text == "(-1)"
    # exponents: sqrt(a) at a = 1e-7 reads 1/(2·sqrt(1e-7)), not 1e-07
    assert trace_expression("sqrt(a)", {"a": 1e-7}).steps[0].edges[0].local_text == "1/(2·sqrt(1e-7))"


def test_toy_page_steps_up_to_the_infinite_gradient_and_marks_its_node():
    # issue 25 item 15: x**0.5 at x = 0 showed only "a gradient is not finite at these values"; no stepper
    from streamlit.testing.v1 import AppTest

    page = str(Path(__file__).resolve().parent.parent / "pages" / "toy_expressions.py")
    at = AppTest.from_file(page, default_timeout=120).run()
    at.text_input(key="expr.text").set_value("x**0.5").run()
    at.number_input(key="expr.var.x").set_value(0.0).run()
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    warnings = [w.value.replace("\\", "") for w in at.warning]
    assert any(w.startswith("The gradient is not finite from step 1 on: L = x ** 0.5") for w in warnings), warnings
    at.button[3].click().run()  # End »: step 1 of 1
    assert any("Step 1 of 1" in m.value for m in at.markdown), [m.value for m in at.markdown]
    steps = at.dataframe[0].value
    assert list(steps["value"]) == ["1", "inf ⚠ not finite"]
    final = at.dataframe[-1].value
    assert list(final["backprop (autograd)"]) == ["inf ⚠ not finite"] and list(final["|difference|"]) == ["n/a"]


def test_toy_page_errors_begin_with_a_capital_letter():
    # issue 27 item 8: "Expression: syntax error at column 4: ..." and "the expression evaluates to nan ..."
    from streamlit.testing.v1 import AppTest

    page = str(Path(__file__).resolve().parent.parent / "pages" / "toy_expressions.py")
    at = AppTest.from_file(page, default_timeout=120).run()
    at.text_input(key="expr.text").set_value("a +* b").run()
    errors = [e.value.replace("\\", "") for e in at.error]  # Markdown-escaped
    assert errors == ["Expression: Syntax error at column 4: invalid syntax."]
    at.text_input(key="expr.text").set_value("log(a)").run()
    at.number_input(key="expr.var.a").set_value(-1.0).run()
    assert [e.value for e in at.error][0].startswith("The expression evaluates to nan at these values"), at.error
