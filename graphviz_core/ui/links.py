"""Links that open the same view for a teammate: the applied config and the graph view's settings live in the URL's
query parameters (`?preset=gpt2-small&collapse=1&colour=flops`), read once when a session opens the page. A link made
from the graph's details panel also names the node shown there (`&node=AddmmBackward0:12`): the page opens with it
selected, in view, and its details shown.

Nothing in a link is executed or names a file: every value is parsed into a config field (then validated by
ModelConfig like the form's), a known option, or search text. A value that does not parse, or no longer fits (a
module the model does not have, a config over this server's budget), falls back to the default with a notice.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Callable, Iterable, Mapping
from urllib.parse import urlencode

import streamlit as st

from graphviz_core.capture.device import check_budget, resolve_device
from graphviz_core.config import CUSTOM, FAMILIES, PRESETS, ModelConfig, config_from_preset, preset_named
from graphviz_core.export.render import METRICS
from graphviz_core.graph.views import module_groups
from graphviz_core.ui.format import escape_markdown

CONFIG_FIELDS = tuple(name for name in ModelConfig.__dataclass_fields__ if name != "preset")
BOOLS = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}
SEARCH_MAX = 200  # characters of search text a link may carry
# characters any one value of a link may have (a node id is the longest: NODE_MAX); a 100,000-character preset= was
# echoed whole in the notice and took 15-30 s a page
PARAM_MAX = 300
# URL name -> (session_state key of the graph view's widget, its default). The defaults are graph_view's own.
VIEW = {
    "hide_shape": ("view.hide_shape", False),
    "collapse": ("view.collapse", False),
    "search": ("view.search", ""),
    "focus": ("view.focus", "(whole model)"),
    "expanded": ("view.expanded", "(none)"),
    "colour": ("view.colour", "category"),
    "size": ("view.size", "(none)"),
}
MODULE_VIEWS = ("focus", "expanded")  # checked against the capture's modules once it is there
NODE = "node"  # URL name of the selected node: an id of the graph as drawn ("AddmmBackward0:12", "module:blocks.0")
NODE_MAX = 300  # characters: ids are an op name and a number, or "module:" and a module path
LINKED_NODE = "link.node"  # session_state: (the config the node belongs to, its id), while the graph shows that config
PENDING = "link.pending_view"
NOTICES = "link.notices"


def prefix_of(form_key: str) -> str:
    """URL prefix of a form: none for the explorer's form, `a.` / `b.` for the compare page's two."""
    return "" if form_key == "config" else form_key.rsplit(".", 1)[-1] + "."


def config_params(config: ModelConfig, prefix: str = "") -> dict[str, str]:
    """The shortest parameters that give `config` back: the preset's name alone while it is exactly that preset,
    otherwise every field that differs from ModelConfig's defaults."""
    if config.preset in PRESETS and config_from_preset(config.preset) == config:
        return {f"{prefix}preset": config.preset}
    default = ModelConfig()
    out = {}
    for name in CONFIG_FIELDS:
        value = getattr(config, name)
        if value != getattr(default, name):
            out[f"{prefix}{name}"] = encode(value)
    return out


def read_params(query) -> tuple[dict[str, str], dict[str, str]]:
    """A link's parameters, one value each, and a sentence for each one that cannot be read (name -> sentence): given
    more than once (Streamlit reads the last, and both stayed in the address bar), or longer than PARAM_MAX. `query`
    is st.query_params, or any mapping with get_all."""
    values, problems = {}, {}
    for name in query:
        given = query.get_all(name)
        shown = name if len(name) <= 40 else name[:40] + "…"
        if len(given) > 1:
            problems[name] = f"{shown}= is given {len(given)} times; a link names each setting once"
        elif given and len(given[0]) > PARAM_MAX:
            problems[name] = f"{shown}= is {len(given[0]):,} characters long, above the {PARAM_MAX} a link's value may have"
        elif given:
            values[name] = given[0]
    return values, problems


def owned_params(names: Iterable[str]) -> tuple[dict[str, str], list[str]]:
    """The link's values of `names` (a page's own parameters) and a sentence for each of them that cannot be read."""
    names = set(names)
    values, problems = read_params(st.query_params)
    return ({k: v for k, v in values.items() if k in names}, [p for k, p in problems.items() if k in names])


def parse_config(params: Mapping[str, str], prefix: str = "") -> tuple[ModelConfig | None, list[str]]:
    """The config a link names (None when it names none, or one that cannot be used) and what was wrong with it."""
    given = {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}
    given = {k: v for k, v in given.items() if k in CONFIG_FIELDS or k == "preset"}
    if not given:
        return None, []
    if long := [name for name, raw in given.items() if len(raw) > PARAM_MAX]:
        return None, [f"{prefix}{name}= is {len(given[name]):,} characters long, above the {PARAM_MAX} a link's "
                      "value may have" for name in long]
    problems = []
    fields: dict = {}
    for name, raw in given.items():
        if name == "preset":
            continue
        value, problem = coerce(name, raw, type(getattr(ModelConfig, name)))
        if problem:
            problems.append(problem)
        else:
            fields[name] = value
    preset = given.get("preset")
    if preset is not None:
        preset = preset_named(preset)  # a link made before a preset was renamed
    if preset is not None and preset not in PRESETS:
        problems.append(f"there is no preset {preset!r}")
        return None, problems
    if problems:
        return None, problems
    if FAMILIES.get(fields.get("model")) is FAMILIES[CUSTOM]:
        return None, ["a link cannot name your own model (the server's trusted folder is picked in the form)"]
    try:
        config = config_from_preset(preset, **fields) if preset else ModelConfig(**fields)
        if preset and fields and config != config_from_preset(preset):
            config = config.replace(preset="")
    except ValueError as exc:
        return None, [str(exc)]
    return config, []


def view_params(state: Mapping) -> dict[str, str]:
    """The graph view's settings that differ from their defaults, and the node a link opened selected, as URL
    parameters."""
    out = {}
    for name, (key, default) in VIEW.items():
        value = state.get(key, default)
        if value != default and value is not None:
            out[name] = encode(value)
    if state.get(LINKED_NODE):
        out[NODE] = state[LINKED_NODE][1]
    return out


def parse_node(params: Mapping[str, str]) -> tuple[str | None, list[str]]:
    """The node id a link asks to open selected, and what was wrong with it. Whether the graph has that node is for
    the graph to say (see `linked_node`): the id is only ever looked up, and escaped wherever it is shown."""
    raw = params.get(NODE)
    if not raw:
        return None, []
    if len(raw) > NODE_MAX or not raw.isprintable():
        return None, [f"node= is not a node id (ids look like AddmmBackward0:12; at most {NODE_MAX} characters)"]
    return raw, []


def parse_view(params: Mapping[str, str]) -> tuple[dict[str, object], list[str]]:
    """Widget values (session_state key -> value) a link asks for, and what was wrong. Module names are returned as
    given: only the capture knows whether they exist (see `apply_pending_view`)."""
    values: dict[str, object] = {}
    problems = []
    options = {"colour": ("category", *METRICS), "size": ("(none)", *METRICS)}
    for name, (key, default) in VIEW.items():
        if name not in params:
            continue
        raw = params[name]
        if isinstance(default, bool):
            if raw.lower() in BOOLS:
                values[key] = BOOLS[raw.lower()]
            else:
                problems.append(f"{name}={raw!r} is not on or off")
        elif name in options:
            if raw in options[name]:
                values[key] = raw
            else:
                problems.append(f"{name}={raw!r} is not one of {', '.join(options[name])}")
        elif name == "search":
            if len(raw) > SEARCH_MAX:
                problems.append(f"the search text is longer than {SEARCH_MAX} characters")
            else:
                values[key] = raw
        else:
            values[key] = raw
    return values, problems


def encode(value: object) -> str:
    """A field's value as a link writes it: on/off as 1/0, anything else as text (`coerce` reads it back)."""
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


def coerce(name: str, raw: str, kind: type) -> tuple[object, str | None]:
    """A link's text for a field of type `kind` (bool, int, else kept as text): (value, None), or (None, what is
    wrong with it)."""
    if kind is bool:
        if raw.lower() in BOOLS:
            return BOOLS[raw.lower()], None
        return None, f"{name}={raw!r} is not on or off"
    if kind is int:  # digits 0-9 only: int() also reads other scripts' digits (hidden=٤٨ was 48)
        if len(raw) > PARAM_MAX or not re.fullmatch(r"[+-]?[0-9]{1,12}", raw.strip()):
            shown = repr(raw) if len(raw) <= 40 else f"{raw[:40]!r}… ({len(raw):,} characters)"
            return None, f"{name}={shown} is not a whole number written with the digits 0-9"
        return int(raw), None
    return raw, None


def link_url(base: str, params: Mapping[str, str]) -> str:
    base = base.split("?", 1)[0]
    return f"{base}?{urlencode(params)}" if params else base


# ---- Streamlit side: read once per session, write on every run, show the link ---------------------------------


def note_problems(form_key: str, problems: list[str], what: str) -> str | None:
    """Keep a notice for this form (shown until its next Run) and return it."""
    if not problems:
        return None
    # The problems are sentences from ValueError ("… got -5."): their closing stops would read ".)" inside brackets
    reasons = "; ".join(p.rstrip(".") for p in problems)
    notice = f"This link's {what} could not be used ({reasons}): the default is shown instead."
    st.session_state.setdefault(NOTICES, {}).setdefault(form_key, []).append(notice)
    return notice


def restore_from_link(form_key: str, load: Callable[[ModelConfig], None]) -> None:
    """Once per session and form: apply the config (and, for the explorer's form, the view) the URL names.
    `load(config)` puts a config into the form (config_form.set_config)."""
    seen = st.session_state.setdefault("link.read", set())
    if form_key in seen:
        return
    seen.add(form_key)
    params, unreadable = read_params(st.query_params)
    prefix = prefix_of(form_key)
    config_names = {f"{prefix}{name}" for name in (*CONFIG_FIELDS, "preset")}
    config, problems = parse_config(params, prefix)
    if bad := [p for k, p in unreadable.items() if k in config_names]:  # a field that cannot be read: the default
        config, problems = None, bad + problems
    loaded = False
    if config is not None:
        try:
            check_budget(config, resolve_device(config.device))
            load(config)
            loaded = True
        except ValueError as exc:
            problems = [str(exc)]
    note_problems(form_key, problems, "config")
    if form_key != "config":
        if loaded:  # the compare page titled this form's expander before the link was read: draw it again
            st.rerun()
        return
    values, problems = parse_view(params)
    node, node_problems = parse_node(params)
    note_problems(form_key, [p for k, p in unreadable.items() if k in (*VIEW, NODE)] + problems + node_problems, "view")
    named_config = any(k in params or k in unreadable for k in (*CONFIG_FIELDS, "preset"))
    if node is not None and (loaded or not named_config):  # a node of a config that could not be used: dropped
        st.session_state[LINKED_NODE] = (config or st.session_state.get(f"{form_key}.applied"), node)
    pending = {k: v for k, v in values.items() if k in (VIEW["focus"][0], VIEW["expanded"][0])}
    for key, value in values.items():
        if key not in pending:
            st.session_state[key] = value
    if pending:
        st.session_state[PENDING] = (config or st.session_state.get(f"{form_key}.applied"), pending)


def restore_choice(name: str, options: list[str], form_key: str = "config", show: bool = False) -> None:
    """Once per session and page: a link's `name=` that is none of `options` (?tab=Bogus), given twice or too long, is
    dropped from the URL with a notice, so the page's own default is what is shown and what the address bar says.
    `show`: the notice is shown here too (a page whose notices were drawn before it knew its options)."""
    seen = st.session_state.setdefault("link.read", set())
    if f"{form_key}:{name}" in seen:  # per page: the explorer's tab= and the parallel page's are different lists
        return
    seen.add(f"{form_key}:{name}")
    values, unreadable = read_params(st.query_params)
    raw = values.get(name)
    if name in unreadable or (raw is not None and raw not in options):
        del st.query_params[name]
        notice = note_problems(form_key, [unreadable.get(name) or f"{name}={raw!r} is not one of {', '.join(options)}"],
                               "view")
        if show and notice:
            st.warning(escape_markdown(notice))


def apply_pending_view(config: ModelConfig, graph) -> None:
    """Once the capture a link asked for is there: focus/expand the modules it names, if the model has them."""
    pending = st.session_state.get(PENDING)
    if not pending or (pending[0] is not None and pending[0] != config):
        return
    del st.session_state[PENDING]
    groups = set(module_groups(graph, depth=2))
    missing = []
    for key, module in pending[1].items():
        if module in groups:
            st.session_state[key] = module
            st.query_params[key.removeprefix("view.")] = module  # the URL was written before the modules were known
        else:
            missing.append(f"{key.removeprefix('view.')}={module!r} is not a module of this model")
    notice = note_problems("config", missing, "view")
    if notice:
        st.warning(escape_markdown(notice))


def linked_node(config: ModelConfig, graph) -> str | None:
    """The node a link asked to open selected, while `graph` (the graph as drawn) is of the config it came with and
    has it; otherwise it is dropped, with a notice when the graph lacks it."""
    linked = st.session_state.get(LINKED_NODE)
    if not linked:
        return None
    linked_config, node = linked
    if linked_config is not None and linked_config != config:  # another config was run since: its node ids differ
        del st.session_state[LINKED_NODE]
        return None
    if node in graph:
        return node
    del st.session_state[LINKED_NODE]
    notice = note_problems("config", [f"node={node!r} is not in this graph as drawn"], "view")
    st.warning(escape_markdown(notice))
    return None


def sync_view_url() -> None:
    """Write the graph view's settings (and the linked node) into the URL. The view's controls rerun only their
    fragment, so this keeps the URL, which the details panel's node links start from, up to date."""
    write_params((*VIEW, NODE), view_params(st.session_state))


def write_params(names: Iterable[str], wanted: Mapping[str, str]) -> None:
    """Make the URL's parameters `names` what `wanted` says: set those given, drop the others."""
    for name in names:
        value = wanted.get(name)
        if st.query_params.get(name) != value or len(st.query_params.get_all(name)) > 1:  # a repeat: written once
            if value is None:
                del st.query_params[name]
            else:
                st.query_params[name] = value


def show_notices(form_key: str, where=None, lead: str = "") -> None:
    for notice in st.session_state.get(NOTICES, {}).get(form_key, []):
        (where or st).warning(escape_markdown(lead + notice))


def dismiss_notices(form_key: str) -> None:
    st.session_state.get(NOTICES, {}).pop(form_key, None)


def sync_url(form_key: str, applied: ModelConfig) -> dict[str, str]:
    """Write this form's config (and the explorer's view) into the URL; returns the parameters this page links to."""
    prefix = prefix_of(form_key)
    mine = {f"{prefix}{name}" for name in (*CONFIG_FIELDS, "preset")}
    wanted = config_params(applied, prefix)
    if form_key == "config":
        mine |= {*VIEW, NODE}
        wanted |= view_params(st.session_state)
    current = {k: st.query_params[k] for k in st.query_params}
    repeated = any(len(st.query_params.get_all(k)) > 1 for k in mine & current.keys())
    if {k: v for k, v in current.items() if k in mine} != wanted or repeated:
        for k in mine & current.keys():
            del st.query_params[k]
        st.query_params.update(wanted)
    return {**{k: v for k, v in current.items() if k not in mine}, **wanted}


# The address bar is the current link: the page writes its config and view there on every run, the graph's fragment
# on each of its own runs. So the box reads it in the browser (every half second, and on Copy): a fragment rerun
# cannot redraw the sidebar, and a Streamlit button would rerun the page and drop the graph's selected node.
LINK_BOX = """
<div class="copy-link" id="{box_id}" style="font-size:0.85rem">
  <label for="{box_id}-url" style="display:block;margin-bottom:0.2rem">Link to this page as it is now:</label>
  <textarea id="{box_id}-url" readonly rows="3" spellcheck="false"
            style="width:100%;box-sizing:border-box;font-family:monospace;font-size:0.75rem;padding:0.3rem;resize:none;
                   word-break:break-all;border:1px solid rgba(49,51,63,0.2);border-radius:0.4rem;
                   background:rgba(240,242,246,0.6)">{url}</textarea>
  <button type="button" style="margin-top:0.35rem;width:100%;padding:0.35rem;border:1px solid rgba(49,51,63,0.2);
          border-radius:0.5rem;background:white;cursor:pointer;font:inherit">Copy link</button>
  <span class="copy-link-status" role="status" style="color:rgba(49,51,63,0.6)"></span>
</div>
<script>
(function () {{
  var box = document.getElementById("{box_id}");
  if (!box || box.dataset.live) {{ return; }}
  box.dataset.live = "1";
  var field = box.querySelector("textarea"), status = box.querySelector(".copy-link-status");
  function current() {{ if (document.activeElement !== field) {{ field.value = window.location.href; }} }}
  var timer = setInterval(function () {{
    if (!document.body.contains(box)) {{ clearInterval(timer); return; }}
    current();
  }}, 500);
  current();
  box.querySelector("button").addEventListener("click", function () {{
    field.value = window.location.href;
    field.select();
    var done = function (copied) {{ status.textContent = copied ? "copied" : "select the link above and copy it"; }};
    var byCommand = function () {{ try {{ done(document.execCommand("copy")); }} catch (e) {{ done(false); }} }};
    // the Clipboard API needs a secure context (https or localhost); a team server on plain http has the command
    if (navigator.clipboard && window.isSecureContext) {{
      navigator.clipboard.writeText(field.value).then(function () {{ done(true); }}, byCommand);
    }} else {{
      byCommand();
    }}
  }});
}})();
</script>
"""


def copy_link(form_key: str, applied: ModelConfig, where) -> None:
    """The link to this page as it is now, always shown, with a Copy link button (see LINK_BOX). The server's own
    idea of the URL is its first value, until the browser's script replaces it with the address bar."""
    url = link_url(st.context.url or "", sync_url(form_key, applied))
    box_id = "copy-link-" + form_key.replace(".", "-")
    where.html(LINK_BOX.format(box_id=box_id, url=html.escape(url, quote=True)), unsafe_allow_javascript=True)


# ---- the toy page: the expression, its values and toggles --------------------------------------------------------

EXPR = "expr"  # URL names on the toy page: expr=, v.NAME= per variable, detach=a,b, twice=1
VALUE_PREFIX = "v."
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]{1,3})?")


def expression_params(text: str, values: Mapping[str, float], detach: Iterable[str], twice: bool) -> dict[str, str]:
    """The toy page as URL parameters: `?expr=(a*b+c)**2&v.a=2&v.b=-3&v.c=10`, plus detach= and twice= when set."""
    out = {EXPR: text, **{f"{VALUE_PREFIX}{name}": f"{value:g}" for name, value in values.items()}}
    if detach := list(detach):
        out["detach"] = ",".join(detach)
    if twice:
        out["twice"] = "1"
    return out


def parse_expression_link(params: Mapping[str, str]) -> tuple[dict | None, list[str]]:
    """What a toy-page link names: {"text", "values", "detach", "twice"}, or None when it names no expression or one
    that cannot be used, and what was wrong. The expression is parsed (never evaluated) by the toy's own parser."""
    from graphviz_core.toy.expressions import parse_expression, variables_of

    text = params.get(EXPR)
    if text is None:
        return None, []
    try:
        variables = variables_of(parse_expression(text))
    except ValueError as exc:
        return None, [f"expr= is not an expression this page takes: {exc}"]
    values, problems = {}, []
    for key, raw in params.items():
        if not key.startswith(VALUE_PREFIX):
            continue
        name = key[len(VALUE_PREFIX):]
        shown = key if len(key) <= 40 else key[:40] + "…"
        if name not in variables:
            problems.append(f"{shown}= names no variable of the expression")
        elif not _DECIMAL.fullmatch(raw.strip()) or not math.isfinite(float(raw)):
            problems.append(f"{shown}={raw[:40]!r} is not a finite number written with the digits 0-9")
        else:
            values[name] = float(raw)
    detach = [v for v in params.get("detach", "").split(",") if v]
    problems += [f"detach={v[:40]!r} is not a variable of the expression" for v in detach if v not in variables]
    twice = params.get("twice", "0").lower()
    if twice not in BOOLS:
        problems.append(f"twice={twice[:40]!r} is not on or off")
    if problems:
        return None, problems
    return {"text": text, "values": values, "detach": detach, "twice": BOOLS[twice]}, []


def restore_expression(key: str, edited: str) -> None:
    """Once per session: the expression, values and toggles a toy-page link names, put into the page's widgets
    (session_state keys `key`.text, .var.NAME, .detach, .twice; the preset box says `edited` until they match one);
    a link that cannot be used leaves the page's first example, with a notice."""
    seen = st.session_state.setdefault("link.read", set())
    if f"{key}:expression" in seen:
        return
    seen.add(f"{key}:expression")
    params, unreadable = read_params(st.query_params)
    ours = [p for k, p in unreadable.items() if k in (EXPR, "detach", "twice") or k.startswith(VALUE_PREFIX)]
    linked, problems = parse_expression_link(params) if not ours else (None, ours)
    if linked is not None:
        st.session_state[f"{key}.preset"] = edited
        st.session_state[f"{key}.text"] = linked["text"]
        for name, value in linked["values"].items():
            st.session_state[f"{key}.var.{name}"] = value
        st.session_state[f"{key}.detach"] = linked["detach"]
        st.session_state[f"{key}.twice"] = linked["twice"]
    note_problems(key, problems, "expression")


def expression_link(key: str, where) -> None:
    """Write the toy page's expression, values and toggles into the URL, and show the link box (LINK_BOX)."""
    from graphviz_core.toy.expressions import parse_expression, variables_of

    text = st.session_state.get(f"{key}.text", "")
    try:
        variables = variables_of(parse_expression(text))
    except ValueError:
        variables = []
    values = {n: st.session_state[f"{key}.var.{n}"] for n in variables if f"{key}.var.{n}" in st.session_state}
    wanted = expression_params(text, values, st.session_state.get(f"{key}.detach", []),
                               bool(st.session_state.get(f"{key}.twice")))
    old = {k for k in st.query_params if k.startswith(VALUE_PREFIX)}
    write_params({EXPR, "detach", "twice", *old, *wanted}, wanted)
    where.html(LINK_BOX.format(box_id=f"copy-link-{key}", url=html.escape(link_url(st.context.url or "", wanted),
                                                                          quote=True)),
               unsafe_allow_javascript=True)
