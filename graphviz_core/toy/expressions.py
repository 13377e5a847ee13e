"""Toy scalar expressions: a safe parser, and a step-by-step trace of real torch autograd over them.

`parse_expression` accepts numbers, variable names, + - * / **, unary minus, parentheses and the functions
exp, log, sqrt, tanh, sigmoid, relu, sin, cos, abs -- checked node by node against a whitelist on Python's
`ast`; nothing is ever passed to `eval`. `trace_expression` builds the expression from one float64 torch
scalar per variable, runs backward with node hooks, and records each step in the order autograd runs it
("Transformer Math"'s walkthrough), plus a central finite difference per variable.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import networkx as nx
import torch

from graphviz_core.capture.walk import autograd_nodes

MAX_LENGTH = 500  # characters
MAX_OPERATIONS = 100
MAX_CONSTANT = 1e6  # |numbers| typed into an expression
FINITE_DIFFERENCE_EPS = 1e-6
FUNCTIONS = ("exp", "log", "sqrt", "tanh", "sigmoid", "relu", "sin", "cos", "abs")
_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Pow: "**"}
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


# "Transformer Math"'s two examples and a fan-out, each with the values it is worked with. The names say the idea.
EXPRESSION_PRESETS: dict[str, tuple[str, dict[str, float]]] = {
    "chain rule, worked by hand: L = (a·b + c)²": ("(a*b + c)**2", {"a": 2.0, "b": -3.0, "c": 10.0}),
    "one neuron's squared error: L = (w·x + b − y)²": ("(w*x + b - y)**2", {"w": 3.0, "x": 2.0, "b": 1.0, "y": 4.0}),
    "fan-out: a used twice, L = a·b + a²": ("a*b + a**2", {"a": 3.0, "b": -2.0}),
    "activations: L = sigmoid(w·x) · tanh(x)": ("sigmoid(w*x) * tanh(x)", {"w": 0.5, "x": 1.5}),
}


# ---- the expression tree ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Num:
    value: float


@dataclass(frozen=True)
class Var:
    name: str


@dataclass(frozen=True)
class BinOp:
    op: str  # one of + - * / **
    left: Expr
    right: Expr


@dataclass(frozen=True)
class Neg:
    operand: Expr


@dataclass(frozen=True)
class Call:
    function: str
    argument: Expr


Expr = Num | Var | BinOp | Neg | Call


ROOT = "L"  # the name of the whole expression, as in "Transformer Math"'s L = (a*b + c)**2

# What a newcomer typed, in words (Python's AST class names mean nothing to them).
_OPERATOR_WORDS = {
    ast.MatMult: "@ (matrix multiplication)", ast.FloorDiv: "// (floor division)", ast.Mod: "% (remainder)",
    ast.BitXor: "^ (for a power, write **)", ast.BitOr: "|", ast.BitAnd: "&", ast.LShift: "<<", ast.RShift: ">>",
}
_UNARY_WORDS = {ast.Not: "not", ast.Invert: "~"}
_CONSTRUCT_WORDS = {
    ast.IfExp: "conditional expressions (x if c else y)", ast.Subscript: "indexing (a[...])",
    ast.Compare: "comparisons (<, ==, ...)", ast.BoolOp: "and / or", ast.Lambda: "lambda functions",
    ast.ListComp: "list comprehensions", ast.SetComp: "set comprehensions", ast.DictComp: "dict comprehensions",
    ast.GeneratorExp: "generator expressions", ast.List: "lists [...]", ast.Tuple: "commas (tuples)",
    ast.Set: "sets {...}", ast.Dict: "dicts {...}", ast.NamedExpr: "assignments (:=)",
    ast.JoinedStr: "f-strings", ast.Starred: "starred arguments (*x)", ast.Await: "await", ast.Yield: "yield",
    ast.YieldFrom: "yield",
}
_ALLOWED = "use numbers, variables, + - * / **, parentheses and the functions " + ", ".join(FUNCTIONS)


def _where(node: ast.AST) -> str:
    return f" at column {getattr(node, 'col_offset', 0) + 1}"


def _typed(source: str, node: ast.AST) -> str:
    """What the user typed for `node`, quoted, cut short, with its column: "'a[0]' at column 1"."""
    segment = ast.get_source_segment(source, node) or ""
    segment = segment if len(segment) <= 40 else segment[:37] + "..."
    return f"{segment!r}{_where(node)}"


def parse_expression(text: str) -> Expr:
    """The expression tree for `text`, or a ValueError whose one sentence points at the problem."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("the expression is empty; type one such as (a*b + c)**2.")
    if len(text) > MAX_LENGTH:
        raise ValueError(f"the expression is {len(text)} characters long; the limit is {MAX_LENGTH}.")
    source = text.strip()
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError as exc:
        column = f" at column {exc.offset}" if exc.offset else ""
        raise ValueError(f"syntax error{column}: {exc.msg}.") from None
    except (RecursionError, MemoryError):
        raise ValueError("the expression is nested too deeply.") from None
    counter = [0]
    try:
        return _convert(tree.body, counter, source)
    except RecursionError:
        raise ValueError("the expression is nested too deeply.") from None


def _convert(node: ast.AST, counter: list[int], source: str) -> Expr:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ValueError(f"only numbers are allowed as constants, not {node.value!r}{_where(node)}.")
        try:
            value = float(node.value)
        except OverflowError:  # an integer literal with hundreds of digits
            value = math.inf
        if not math.isfinite(value) or abs(value) > MAX_CONSTANT:
            raise ValueError(f"the number {node.value!r}{_where(node)} is too large (limit {number_text(MAX_CONSTANT)}).")
        return Num(value)
    if isinstance(node, ast.Name):
        if node.id.startswith("_") or not _NAME.match(node.id):
            raise ValueError(f"the name {node.id!r}{_where(node)} is not allowed; a name starts with a letter A-Z or "
                             "a-z, then those letters, digits 0-9 and _.")
        if node.id in FUNCTIONS:
            raise ValueError(f"{node.id!r}{_where(node)} is a function; call it, e.g. {node.id}(x).")
        if node.id == ROOT:
            # L names the whole expression in every step ("dL/da"); a variable L would read as the result.
            raise ValueError(f"the name {ROOT}{_where(node)} is kept for the result ({ROOT} = the whole expression); "
                             f"rename the variable, e.g. to l or {ROOT}1.")
        return Var(node.id)
    counter[0] += 1
    if counter[0] > MAX_OPERATIONS:
        raise ValueError(f"the expression has more than {MAX_OPERATIONS} operations; make it shorter.")
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return BinOp(_BINARY[type(node.op)], _convert(node.left, counter, source), _convert(node.right, counter, source))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return Neg(_convert(node.operand, counter, source))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd):
        return _convert(node.operand, counter, source)  # +a is a
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name):
            raise ValueError(f"only the functions {', '.join(FUNCTIONS)} can be called{_where(node)}.")
        if node.func.id not in FUNCTIONS:
            raise ValueError(f"unknown function {node.func.id!r}{_where(node)}; allowed: {', '.join(FUNCTIONS)}.")
        if len(node.args) != 1 or node.keywords:
            raise ValueError(f"{node.func.id}(){_where(node)} takes exactly one argument.")
        return Call(node.func.id, _convert(node.args[0], counter, source))
    if isinstance(node, ast.Attribute):
        raise ValueError(f"attribute access (.{node.attr}){_where(node)} is not allowed.")
    if isinstance(node, ast.BinOp):
        word = _OPERATOR_WORDS.get(type(node.op), "this operator")
        raise ValueError(f"the operator {word} cannot be used (you typed {_typed(source, node)}); {_ALLOWED}.")
    if isinstance(node, ast.UnaryOp):
        word = _UNARY_WORDS.get(type(node.op), "this operator")
        raise ValueError(f"the operator {word} cannot be used (you typed {_typed(source, node)}); {_ALLOWED}.")
    words = _CONSTRUCT_WORDS.get(type(node), "this kind of expression")
    raise ValueError(f"{words} cannot be used (you typed {_typed(source, node)}); {_ALLOWED}.")


def variables_of(expr: Expr) -> list[str]:
    """Variable names in order of first appearance."""
    seen: dict[str, None] = {}
    for node in _walk(expr):
        if isinstance(node, Var):
            seen.setdefault(node.name, None)
    return list(seen)


def _children(expr: Expr) -> list[Expr]:
    """The operands of a node, left to right (none for numbers and variables)."""
    if isinstance(expr, BinOp):
        return [expr.left, expr.right]
    if isinstance(expr, Neg):
        return [expr.operand]
    if isinstance(expr, Call):
        return [expr.argument]
    return []


def _walk(expr: Expr) -> Iterable[Expr]:
    yield expr
    for child in _children(expr):
        yield from _walk(child)


def parse_assignments(items: Iterable[str]) -> dict[str, float]:
    """["a=2", "b=-3"] -> {"a": 2.0, "b": -3.0}, with a sentence for anything malformed or given twice."""
    values: dict[str, float] = {}
    given: dict[str, str] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"expected NAME=VALUE, got {item!r}.")
        if not _NAME.match(name.strip()):
            raise ValueError(f"{name.strip()!r} in {item!r} is not a variable name: a name starts with a letter A-Z "
                             "or a-z, then those letters, digits 0-9 and _.")
        if name.strip() in given:
            raise ValueError(f"{name.strip()} is given twice ({given[name.strip()]}, then {item.strip()}); "
                             f"give each variable one value.")
        given[name.strip()] = item.strip()
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"the value of {name.strip()} is not a number: {raw!r}.") from None
        if not math.isfinite(value):
            raise ValueError(f"the value of {name.strip()} must be finite, got {raw!r}.")
        values[name.strip()] = value
    return values


# ---- evaluation and trace --------------------------------------------------------------------------------

_TORCH_FUNCTIONS = {
    "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "relu": torch.relu, "sin": torch.sin, "cos": torch.cos, "abs": torch.abs,
}
_TORCH_BINARY = {"+": torch.add, "-": torch.sub, "*": torch.mul, "/": torch.div, "**": torch.pow}


@dataclass(frozen=True)
class EdgeStep:
    """The gradient one backward step sends to one input."""

    to: str  # the input's name (a variable or an intermediate)
    local: float  # ∂(this node)/∂(input), from the forward values
    local_text: str  # how the local derivative is computed, e.g. "b = -3"
    grad: float  # upstream × local, as autograd computed it


@dataclass(frozen=True)
class Step:
    """One node of the backward pass, in the order autograd ran it."""

    index: int
    node: str  # our name for it: an intermediate (d, e, L) or a variable (a.grad)
    op: str  # PyTorch's node name: MulBackward0, AccumulateGrad…
    formula: str  # d = a * b
    upstream: float  # dL/d(node): the gradient arriving
    edges: tuple[EdgeStep, ...] = ()
    accumulated: float | None = None  # for AccumulateGrad: the variable's .grad after this step
    backward_pass: int = 1  # 2 for the steps of a second backward without zeroing .grad
    before: float | None = None  # for AccumulateGrad: the variable's .grad before this step (None: unset)


@dataclass(frozen=True)
class Intermediate:
    name: str
    formula: str  # "a * b"
    value: float
    inputs: tuple[str, ...]  # names of inputs that carry gradient (variables or intermediates)
    op: str | None  # PyTorch's backward node (MulBackward0), None when only constants feed it
    kind: str = "arithmetic"  # "arithmetic" (+ - * / ** and unary minus) or "function" (exp, relu, ...)


@dataclass(frozen=True)
class FiniteDifference:
    """The numerical derivative of L in one variable, how it was taken, and what it says about L there."""

    value: float | None  # None where L is not finite on either side within the smallest step tried
    method: str  # "central", "forward" (x, x + h), "backward" (x - h, x) or "none"
    step: float  # h
    left: float | None = None  # (L(x) - L(x - h)) / h: the slope from the left
    right: float | None = None  # (L(x + h) - L(x)) / h: the slope from the right
    kink: bool = False  # the two sides disagree and keep disagreeing as h halves: no derivative at x
    note: str = ""  # one sentence for a user; "" when the central difference with ε is unremarkable


@dataclass(frozen=True)
class Trace:
    """Forward values, every backward step, final gradients and their finite-difference check."""

    expression: str
    values: dict[str, float]
    value: float
    intermediates: tuple[Intermediate, ...]
    steps: tuple[Step, ...]
    grads: dict[str, float | None]  # None for a detached variable: no path from L reaches it
    numerical_grads: dict[str, float | None]  # None where no finite difference exists (see finite_differences)
    epsilon: float
    detached: tuple[str, ...] = ()
    backward_passes: int = 1
    grads_after_each_pass: tuple[dict[str, float | None], ...] = field(default=())
    finite_differences: dict[str, FiniteDifference] = field(default_factory=dict)
    # The step whose node sent a gradient that is not finite (sqrt or log at 0, 0 to a negative power): `steps`
    # end with it, since everything backward does after it only carries that inf or nan on. None: all finite.
    non_finite_step: int | None = None

    def non_finite_node(self, revealed_steps: int) -> str | None:
        """The node that sent the gradient that is not finite, once the stepper has reached its step."""
        if self.non_finite_step is None or revealed_steps <= self.non_finite_step:
            return None
        return self.steps[self.non_finite_step].node

    @property
    def non_finite_sentence(self) -> str:
        """What went wrong at `non_finite_step`, in one sentence; "" when every gradient is finite."""
        if self.non_finite_step is None:
            return ""
        step = self.steps[self.non_finite_step]
        sent = "; ".join(f"{number_text(e.grad)} to {e.to} (local derivative {e.local_text})"
                         for e in step.edges if not math.isfinite(e.grad))
        sent = sent or f"on the {number_text(step.upstream)} it received"
        return (f"The gradient is not finite from step {step.index + 1} on: {step.formula} ({step.op}) sends {sent}, "
                f"and backward only carries it on from there, so the steps stop at that node.")

    def to_dict(self) -> dict:
        data = asdict(self)
        data["steps"] = [asdict(s) for s in self.steps]
        return data

    def to_json_dict(self) -> dict:
        """`to_dict` with every non-finite float (NaN, ±inf) replaced by None and named in `notes`, so that
        `json.dumps(..., allow_nan=False)` writes valid JSON."""
        notes: list[str] = []
        data = _finite_only(self.to_dict(), "", notes)
        data["notes"] = notes + [f"finite_differences.{name}: {fd.note}" for name, fd in self.finite_differences.items()
                                 if fd.note]
        if self.non_finite_step is not None:
            data["notes"].append(f"steps[{self.non_finite_step}]: {self.non_finite_sentence}")
        return data


def _finite_only(value, path: str, notes: list[str]):
    """`value` with non-finite floats as None, each one's path and value noted."""
    if isinstance(value, float) and not math.isfinite(value):
        notes.append(f"{path}: {value} as a float (written as null)")
        return None
    if isinstance(value, float) and value == 0:
        return 0.0  # never -0.0: zero is 0
    if isinstance(value, dict):
        return {k: _finite_only(v, f"{path}.{k}" if path else str(k), notes) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_only(v, f"{path}[{i}]", notes) for i, v in enumerate(value)]
    return value


def number_text(x: float, *, digits: int = 6, bracket_negative: bool = False) -> str:
    """How the toy writes a number, in formulas, tables, the graph and notes: `digits` significant digits, zero as
    0 (never -0), an exponent without padding or plus sign (1e-7, 1e20), nan and inf by name.

    `bracket_negative`: a negative in brackets, for a number that follows an operator (1 × (-2), 2^(-0.5)); a
    number alone, or already inside a function's brackets (tanh(-2)), is written bare.
    """
    if x == 0:  # -0.0 == 0: IEEE's signed zero means nothing to a reader
        return "0"
    text = f"{x:.{digits}g}"
    mantissa, e, exponent = text.partition("e")
    if e:
        text = f"{mantissa}e{int(exponent)}"
    return f"({text})" if bracket_negative and x < 0 else text


def _fmt(x: float) -> str:
    """A number after an operator: a negative in brackets, once."""
    return number_text(x, bracket_negative=True)


def _names(expr: Expr, variables: Iterable[str]) -> dict[int, str]:
    """Names for intermediates, in evaluation order: the next free letters after the variables ("Transformer Math"'s
    d, e), then t1, t2... (skipping any a variable has taken) once letters run out; the root is always L."""
    taken = set(variables) | {ROOT}
    spare = iter([c for c in "defghijkmnopqrstuvwxyz" if c not in taken]
                 + [f"t{k}" for k in range(1, 2 * MAX_OPERATIONS + 2) if f"t{k}" not in taken])
    order = [n for n in _postorder(expr) if isinstance(n, (BinOp, Neg, Call))]
    return {id(node): ROOT if node is expr else next(spare) for node in order}


def _postorder(expr: Expr) -> list[Expr]:
    out: list[Expr] = []

    def visit(node: Expr) -> None:
        for child in _children(node):
            visit(child)
        out.append(node)

    visit(expr)
    return out


def _safe(compute) -> float:
    """A display-only derivative: NaN where float maths fails (autograd's own gradient is reported anyway)."""
    try:
        return float(compute())
    except (ZeroDivisionError, OverflowError, ValueError, TypeError):  # TypeError: a complex power, (-1) ** -0.5
        return math.nan


def _divide(a: float, b: float) -> float:
    """a / b as IEEE floats (and autograd) divide: 1/0 = inf, 0/0 = nan, where Python raises."""
    if b != 0:
        return a / b
    return math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a) * math.copysign(1.0, b)


def _power(x: float, exponent: float) -> float:
    """x ** exponent as IEEE floats: 0 to a negative power is inf, where Python raises."""
    return math.inf if x == 0 and exponent < 0 else x**exponent


def _local_derivatives(node: Expr, args: list[float], result: float) -> list[tuple[float, str]]:
    """∂result/∂arg for each argument, with the computation written out (for the step table)."""
    if isinstance(node, Neg):
        return [(-1.0, _fmt(-1.0))]
    if isinstance(node, Call):
        x = args[0]
        table = {
            "exp": (lambda: math.exp(x), f"exp({number_text(x)})"),
            "log": (lambda: _divide(1.0, x), f"1/{_fmt(x)}"),
            "sqrt": (lambda: _divide(1.0, 2 * result), f"1/(2·sqrt({number_text(x)}))"),
            "tanh": (lambda: 1 - result**2, f"1 - tanh({number_text(x)})²"),
            "sigmoid": (lambda: result * (1 - result), f"σ·(1-σ) = {_fmt(result)}·{_fmt(1 - result)}"),
            "relu": (lambda: 1.0 if x > 0 else 0.0, f"1 if {number_text(x)} > 0 else 0"),
            "sin": (lambda: math.cos(x), f"cos({number_text(x)})"),
            "cos": (lambda: -math.sin(x), f"-sin({number_text(x)})"),
            "abs": (lambda: math.copysign(1.0, x) if x else 0.0, f"sign({number_text(x)})"),
        }
        compute, text = table[node.function]
        return [(_safe(compute), text)]
    x, y = args
    if node.op == "+":
        return [(1.0, "1"), (1.0, "1")]
    if node.op == "-":
        return [(1.0, "1"), (-1.0, _fmt(-1.0))]
    if node.op == "*":
        return [(y, _fmt(y)), (x, _fmt(x))]
    if node.op == "/":
        return [(_safe(lambda: _divide(1.0, y)), f"1/{_fmt(y)}"), (_safe(lambda: _divide(-x, y**2)), f"-{_fmt(x)}/{_fmt(y)}²")]
    if x == 0 and y > 0:
        # x^y·ln x -> 0 as x -> 0+ (for y > 0): the limit, as PyTorch's pow backward also gives 0 there
        by_y = (0.0, f"0^{_fmt(y)}·ln 0 → 0 (the limit as the base → 0)")
    else:
        by_y = (_safe(lambda: result * math.log(x)), f"{_fmt(x)}^{_fmt(y)}·ln {_fmt(x)}")
    return [(_safe(lambda: y * _power(x, y - 1)), f"{_fmt(y)}·{_fmt(x)}^{_fmt(y - 1)}"), by_y]


def _formula(node: Expr, child_text: list[str]) -> str:
    if isinstance(node, BinOp):
        return f"{child_text[0]} {node.op} {child_text[1]}"
    if isinstance(node, Neg):
        return f"-{child_text[0]}"
    return f"{node.function}({child_text[0]})"


def _evaluate_float(expr: Expr, values: dict[str, float]) -> float:
    """The expression in plain float64 torch, without autograd (used for finite differences)."""
    with torch.no_grad():
        tensors = {k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()}
        return float(_build(expr, tensors, {}, set(), {})[0])


def _build(expr, tensors, names, detached, record):
    """Evaluate `expr` with torch ops; `record[id(node)]` = (tensor, name, formula, input names)."""

    def visit(node):
        if isinstance(node, Num):
            return torch.tensor(node.value, dtype=torch.float64), _fmt(node.value), None
        if isinstance(node, Var):
            tensor = tensors[node.name]
            return (tensor.detach() if node.name in detached else tensor), node.name, node.name
        visited = [visit(c) for c in _children(node)]
        operands = [v[0] for v in visited]
        if isinstance(node, BinOp):
            out = _TORCH_BINARY[node.op](operands[0], operands[1])
        elif isinstance(node, Neg):
            out = torch.neg(operands[0])
        else:
            out = _TORCH_FUNCTIONS[node.function](operands[0])
        name = names.get(id(node), "?")
        record[id(node)] = (node, out, name, _formula(node, [v[1] for v in visited]),
                            [v[2] for v in visited], [float(o.detach()) for o in operands])
        return out, name, name

    return visit(expr)


def trace_expression(
    text: str,
    values: dict[str, float],
    *,
    detach: Iterable[str] = (),
    backward_passes: int = 1,
    epsilon: float = FINITE_DIFFERENCE_EPS,
) -> Trace:
    """Run forward + backward on `text` with real torch autograd and record every backward step.

    `detach`: variables used through `.detach()` (their path disappears, their gradient stays None).
    `backward_passes`: 2 runs backward twice without zeroing, so .grad accumulates ("Backprop as Graph Transformation": += not =).
    """
    expr = parse_expression(text)
    variables = variables_of(expr)
    missing = [v for v in variables if v not in values]
    if missing:
        raise ValueError(f"give a value for {', '.join(missing)} (e.g. {missing[0]}=1).")
    unknown_detach = sorted(set(detach) - set(variables))
    if unknown_detach:
        raise ValueError(f"cannot detach {', '.join(unknown_detach)}: not a variable of this expression.")
    if backward_passes not in (1, 2):
        raise ValueError("backward_passes must be 1 or 2.")
    detached = set(detach)
    tensors = {v: torch.tensor(float(values[v]), dtype=torch.float64, requires_grad=True) for v in variables}
    names = _names(expr, variables)
    record: dict[int, tuple] = {}
    output, _, _ = _build(expr, tensors, names, detached, record)
    value = float(output.detach())
    if not math.isfinite(value):
        raise ValueError(f"the expression evaluates to {value} at these values (overflow or an undefined "
                         f"operation such as log of a negative number); change the values.")
    intermediates = tuple(
        Intermediate(name, formula, float(tensor.detach()), tuple(i for i in inputs if i is not None and i not in detached),
                     tensor.grad_fn.name() if tensor.grad_fn is not None else None,
                     "function" if isinstance(node, Call) else "arithmetic")
        for node, tensor, name, formula, inputs, _args in record.values()  # filled in evaluation order
    )
    steps: list[Step] = []
    per_pass: list[dict[str, float | None]] = []
    if output.grad_fn is not None:
        current_pass = [1]
        handles = _hook_steps(output.grad_fn, record, tensors, detached, steps, current_pass)
        for pass_index in range(backward_passes):
            current_pass[0] = pass_index + 1
            output.backward(retain_graph=pass_index + 1 < backward_passes)
            per_pass.append({v: (None if tensors[v].grad is None else float(tensors[v].grad)) for v in variables})
        for handle in handles:
            handle.remove()
    else:
        per_pass = [{v: None for v in variables}] * backward_passes
    grads = per_pass[-1]
    non_finite = next((s.index for s in steps if not math.isfinite(s.upstream)
                       or any(not math.isfinite(e.grad) for e in s.edges)), None)
    if non_finite is not None:
        del steps[non_finite + 1:]
    at_zero = sorted({rec[0].function for rec in record.values()
                      if isinstance(rec[0], Call) and rec[0].function in KINKS and rec[5][0] == 0.0})
    differences = {v: finite_difference(lambda x, v=v: _evaluate_float(expr, {**values, v: x}), float(values[v]), v,
                                        epsilon, autograd=_finite_or_none(per_pass[0][v]), kinked_functions=at_zero)
                   for v in variables}
    return Trace(text.strip(), {v: float(values[v]) for v in variables}, value, intermediates, tuple(steps), grads,
                 {v: d.value for v, d in differences.items()}, epsilon, tuple(sorted(detached)), backward_passes,
                 tuple(per_pass), differences, non_finite)


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _hook_steps(root, record, tensors, detached, steps, current_pass):
    """Hook every node of the expression's backward graph: op nodes record their edges, leaves their +=."""
    op_records = {rec[1].grad_fn: rec for rec in record.values() if rec[1].grad_fn is not None}
    leaves = {id(tensor): name for name, tensor in tensors.items() if name not in detached}
    handles = []
    for node in autograd_nodes(root):
        if node in op_records:
            handles.append(node.register_hook(_op_hook(node, op_records[node], steps, current_pass)))
        elif id(getattr(node, "variable", None)) in leaves:
            handles.append(node.register_prehook(_leaf_hook(leaves[id(node.variable)], tensors, steps, current_pass)))
    return handles


def _op_hook(node, rec, steps, current_pass):
    expr_node, tensor, name, formula, inputs, args = rec

    def hook(grad_inputs, grad_outputs):
        upstream = float(grad_outputs[0])
        locals_ = _local_derivatives(expr_node, args, float(tensor.detach()))
        edges = []
        for (child, _), grad, (local, local_text), input_name in zip(node.next_functions, grad_inputs, locals_, inputs, strict=True):
            if child is None or grad is None or input_name is None:
                continue  # a constant or a detached variable: no gradient flows there
            edges.append(EdgeStep(input_name, local, local_text, float(grad)))
        steps.append(Step(len(steps), name, node.name(), f"{name} = {formula}", upstream, tuple(edges),
                          backward_pass=current_pass[0]))

    return hook


def _leaf_hook(name, tensors, steps, current_pass):
    # A pre-hook: it runs before AccumulateGrad adds into .grad, so "before" is still the old value.
    def hook(grad_outputs):
        incoming = float(grad_outputs[0])
        before = None if tensors[name].grad is None else float(tensors[name].grad)
        after = incoming + (0.0 if before is None else before)
        steps.append(Step(len(steps), name, "AccumulateGrad", f"{name}.grad += dL/d{name}", incoming, (), after,
                          current_pass[0], before))

    return hook


# Functions with a kink at 0, and the one-sided slope PyTorch's backward takes there.
KINKS = {"relu": "relu'(0) = 0, the slope of its left side", "abs": "abs'(0) = sign(0) = 0, between its sides' -1 and 1"}


def finite_difference(f, x: float, name: str, epsilon: float = FINITE_DIFFERENCE_EPS, *,
                      autograd: float | None = None, kinked_functions: Iterable[str] = ()) -> FiniteDifference:
    """The numerical derivative of `f` at `x`: a central difference, with step h = ε·max(1, |x|) where it can.

    The step shrinks by 10 while x ± h leaves f's domain (sqrt or log just above 0: f is not finite there)
    or while the one-sided slopes (f(x) - f(x-h))/h and (f(x+h) - f(x))/h still move as h halves (a pole, or
    a kink, within h of x). Once they have settled: where they agree, the central difference is the
    derivative; where they settle apart, f has a kink at x (a smooth f's sides differ by about f''·h, which
    halves with h; a kink's difference stays). No settled step down to 1e-13·max(1, |x|): one side, or none.
    """
    fx = f(x)
    h0 = h = epsilon * max(1.0, abs(x))
    floor = 1e-13 * max(1.0, abs(x))
    left_domain = False
    rough: tuple[float, float] | None = None  # (central, h) at the smallest finite step, if none settles
    while h >= floor:
        up, down, up2, down2 = f(x + h), f(x - h), f(x + h / 2), f(x - h / 2)
        if not all(math.isfinite(v) for v in (up, down, up2, down2)):
            left_domain, h = True, h / 10
            continue
        left, right = (fx - down) / h, (up - fx) / h
        left2, right2 = (fx - down2) / (h / 2), (up2 - fx) / (h / 2)
        noise = 64 * 2.2e-16 * max(abs(fx), abs(up), abs(down)) / (h / 2)  # float rounding in the slopes
        tolerance = 1e-4 * max(1.0, abs(left2), abs(right2)) + noise
        rough = ((up - down) / (2 * h), h)
        if abs(left - left2) <= tolerance and abs(right - right2) <= tolerance:
            break
        h /= 10
    else:
        if rough is None:
            return _one_sided(f, x, fx, name, h0)
        central, h = rough
        return FiniteDifference(central, "central", h, note=(
            f"The slopes on either side of {name} = {number_text(x)} never settled (steps {number_text(h0)} down to {number_text(h)}): the expression "
            f"changes too fast here (a pole or a jump nearby), so this central difference is rough."))
    central = (up - down) / (2 * h)
    kink = abs(right2 - left2) > tolerance and abs(right2 - left2) > 0.75 * abs(right - left)
    if kink:
        note = _kink_note(name, x, h, left2, right2, central, autograd, kinked_functions)
    elif h < h0:
        why = (f"Stepping {name} = {number_text(x)} by ±{number_text(h0)} leaves the domain (the expression is not finite there)"
               if left_domain else
               f"At the step ±{number_text(h0)} the slopes on either side of {name} = {number_text(x)} had not settled (the expression "
               f"bends sharply, or breaks, within {number_text(h0)} of it)")
        note = f"{why}, so the central difference uses the smaller step {number_text(h)}."
    else:
        note = ""
    return FiniteDifference(central, "central", h, left2, right2, kink, note)


def _kink_note(name, x, h, left, right, central, autograd, kinked_functions) -> str:
    where = (f"at {name} = {number_text(x)}" if kinked_functions else f"at or within {number_text(h)} of {name} = {number_text(x)}")
    note = (f"The expression has a kink {where}: its slope is {number_text(left)} from the left and {number_text(right)} from the "
            f"right, so it has no derivative there.")
    if autograd is not None:
        close = 1e-3 * max(1.0, abs(left), abs(right))
        side = ("the left-hand slope" if abs(autograd - left) <= close else
                "the right-hand slope" if abs(autograd - right) <= close else "a value between the two sides")
        why = "; ".join(KINKS[k] for k in kinked_functions)
        note += f" Autograd reports {number_text(autograd)}, {side}" + (f", because PyTorch defines {why}." if why else ".")
    return note + f" The central difference ({number_text(central)}) averages the two sides; neither number is wrong."


def _one_sided(f, x: float, fx: float, name: str, epsilon: float) -> FiniteDifference:
    if math.isfinite(up := f(x + epsilon)):
        return FiniteDifference((up - fx) / epsilon, "forward", epsilon,
                                note=f"The expression is not finite just below {name} = {number_text(x)}, so the difference "
                                     f"looks forward only: (L({name} + h) − L({name})) / h with h = {number_text(epsilon)}.")
    if math.isfinite(down := f(x - epsilon)):
        return FiniteDifference((fx - down) / epsilon, "backward", epsilon,
                                note=f"The expression is not finite just above {name} = {number_text(x)}, so the difference "
                                     f"looks backward only: (L({name}) − L({name} − h)) / h with h = {number_text(epsilon)}.")
    return FiniteDifference(None, "none", epsilon,
                            note=f"The expression is not finite on either side of {name} = {number_text(x)} (steps {number_text(epsilon)} "
                                 f"down to 1e-13), so there is no finite difference to check autograd against.")


# ---- the trace as a graph (graph/schema.py's records), for the shared renderer ----------------------------------


# The toy graph's categories, from the schema's names: an expression has no residual stream, loss or modules.
# Every + is plain arithmetic here (category_of would call AddBackward0 a residual add), every function an
# activation, every variable a leaf whose .grad accumulates, and an operation fed only by numbers "other".
TOY_CATEGORIES = {"arithmetic": "elementwise", "function": "activation"}


def trace_graph(trace: Trace, revealed_steps: int) -> nx.DiGraph:
    """The expression's backward graph after `revealed_steps` steps: forward values on every node,
    gradients on the edges (and nodes) that backward has reached so far."""
    done = trace.steps[:revealed_steps]
    upstream = {s.node: s.upstream for s in done if s.op != "AccumulateGrad"}
    accumulated = {s.node: s.accumulated for s in done if s.op == "AccumulateGrad"}
    edge_grads = {(s.node, e.to): e.grad for s in done for e in s.edges}
    broken = trace.non_finite_node(revealed_steps)
    graph = nx.DiGraph()
    for item in reversed(trace.intermediates):  # the root (L) first, as in a capture
        lines = [f"{item.name} = {item.formula}", f"= {number_text(item.value)}"]
        if item.name in upstream:
            lines.append(f"dL/d{item.name} = {number_text(upstream[item.name])}")
        if item.name == broken:
            lines.append("⚠ sends a gradient that is not finite")
        graph.add_node(item.name, **_schema_node(item.op or "constant", TOY_CATEGORIES[item.kind] if item.op else "other",
                                                 "\n".join(lines), _node_rows(trace, item.name)))
    for name, value in trace.values.items():
        lines = [f"{name} = {number_text(value)}"]
        if name in trace.detached:
            lines.append("detached: grad None")
        elif name in accumulated:
            lines.append(f"grad = {number_text(accumulated[name])}")
        graph.add_node(name, **_schema_node("AccumulateGrad", "accumulate_grad", "\n".join(lines), _node_rows(trace, name)))
    for item in trace.intermediates:
        for child in item.inputs:
            grad = edge_grads.get((item.name, child))
            graph.add_edge(item.name, child, label="" if grad is None else gradient_text(grad))
    return graph


def _schema_node(op: str, category: str, label: str, details: list[list[str]]) -> dict:
    return dict(op=op, category=category, module="", saved_bytes=0, flops=0, recompute_flops=0, time_s=None,
                grad_norm=None, param=None, saved=[], label=label, details=details)


def _node_rows(trace: Trace, name: str) -> list[list[str]]:
    rows = [["name", name]]
    for item in trace.intermediates:
        if item.name == name:
            rows += [["formula", f"{name} = {item.formula}"], ["value", number_text(item.value)], ["autograd node", item.op or "(constant)"]]
    if name in trace.values:
        rows += [["value", number_text(trace.values[name])],
                 ["gradient", "None (detached)" if trace.grads.get(name) is None else number_text(trace.grads[name])],
                 ["finite difference", _difference_text(trace, name)]]
    for step in trace.steps:
        if step.node == name:
            rows.append([f"step {step.index + 1}", f"upstream dL/d{name} = {number_text(step.upstream)}"])
    return rows


def _difference_text(trace: Trace, name: str) -> str:
    """"0.75 (central, h = 1e-06)" or "none" for the node details."""
    fd = trace.finite_differences.get(name)
    if fd is None or fd.value is None:
        return "none (the expression is not finite near this value)"
    return f"{number_text(fd.value, digits=8)} ({fd.method}, h = {number_text(fd.step)})" + (", a kink: no derivative here" if fd.kink else "")


def step_table(trace: Trace, revealed_steps: int) -> list[dict[str, str]]:
    """"Transformer Math"'s table (gradient, computation, value) for the steps revealed so far.

    Rows are numbered from 1, as the stepper's "Step k of n" is. With two backward passes each pass starts
    again at dL/dL = 1 and its sums count only its own paths; the += then adds to what pass 1 left.
    """
    passes = trace.backward_passes > 1

    def start(number: int) -> dict[str, str]:
        row = {"step": "", "gradient": "dL/dL", "computation": "by definition", "value": "1"}
        if passes:
            again = "" if number == 1 else " (backward again, .grad not zeroed)"
            return {"pass": str(number), **row, "computation": "by definition" + again}
        return row

    rows = [start(1)]
    contributions: dict[str, list[float]] = {}
    current = 1
    for step in trace.steps[:revealed_steps]:
        if step.backward_pass != current:
            current = step.backward_pass
            contributions = {}  # a new pass: its paths are its own
            rows.append(start(current))
        prefix = {"pass": str(step.backward_pass)} if passes else {}
        if step.op == "AccumulateGrad":
            parts = contributions.get(step.node, [step.upstream])
            how = " + ".join(_fmt(p) for p in parts) + (f" (sum over {len(parts)} paths)" if len(parts) > 1 else "")
            if step.before is not None:
                how += f"; .grad was {number_text(step.before)}, so {_fmt(step.before)} + {_fmt(step.upstream)}"
            rows.append({**prefix, "step": str(step.index + 1), "gradient": f"{step.node}.grad",
                         "computation": f"{step.node}.grad += {how}", "value": number_text(step.accumulated)})
            continue
        for edge in step.edges:
            contributions.setdefault(edge.to, []).append(edge.grad)
            rows.append({**prefix, "step": str(step.index + 1), "gradient": f"dL/d{edge.to} (via {step.node})",
                         "computation": f"dL/d{step.node} × d{step.node}/d{edge.to} = {_fmt(step.upstream)} × {edge.local_text}",
                         "value": gradient_text(edge.grad)})
    return rows


NOT_FINITE_MARK = "⚠ not finite"


def gradient_text(grad: float) -> str:
    """A gradient for the table and the graph's edges, marked where it is not finite (inf or nan)."""
    return number_text(grad) if math.isfinite(grad) else f"{number_text(grad)} {NOT_FINITE_MARK}"
