"""The metric names the docs give are the ones /metrics has, and every family /metrics can have
is documented in its list: extproc's own in docs/operations.md, flow control's
(`extproc_flow_*`) in docs/flow-control.md, llm-d's and GIE's in docs/llm-d.md.

The exported families are read from the code, not from a running picker, so every optional
component counts: the stats tables (server/families.py), llm-d's families as LlmdMetrics
yields them for a pool with fresh figures, and every other string literal of the package
spelled like a metric name (the exporter's, flow control's, the latency wiring's gauges and
counters). A literal whose constructor is not known below fails the test, so a new way of
building a family cannot slip past it.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import re
from functools import cache

import pytest

from tests.docs.doc_texts import ROOT, code_spans, doc_texts, section, table_rows

PREFIX = r"(?:extproc|llm_d_epp|inference_(?:objective|pool|extension))"
NAME = re.compile(PREFIX + r"_[a-z0-9_]+")
# A name as the docs write it: `{a,b}` right after an underscore lists alternatives
# (`extproc_kv_events_{messages,gaps}_total`), a trailing `*` makes it a prefix; braces
# after a letter are labels and not part of the name.
MENTION = re.compile(PREFIX + r"(?:_(?:[a-z0-9]+|\{[a-z0-9_,]+\}))+_?\*?")
SUFFIXES = {"counter": {"_total"}, "gauge": {""}, "histogram": {"", "_bucket", "_sum", "_count"}}

# How each family-building call of the package names its kind (positional name argument).
CONSTRUCTORS = {
    "gauge": "gauge",
    "gauge_family": "gauge",
    "GaugeMetricFamily": "gauge",
    "counter": "counter",
    "Counter": "counter",  # prometheus_client's
    "CounterMetricFamily": "counter",
    "Histogram": "histogram",  # prometheus_client's
    "_Latency": "histogram",  # server/metrics.py
    "_shared": "gauge",  # exporter.py: a sharing loop's degraded gauge
}

# Names the docs spell like a metric that are no metric of ours, with the reason.
NOT_METRICS = {
    "extproc_streams_per_connection": "an `extproc envoy-config` option (BootstrapOptions)",
}
NOT_EXPORTED_HEADING = "### Not exported, and why"  # docs/llm-d.md: llm-d names we lack

# Families deliberately left out of the docs, with the reason (none today).
UNDOCUMENTED: dict[str, str] = {}


def _literal_kind(call: ast.Call, name: str) -> str | None:
    func = call.func
    fn = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
    if fn in ("one", "Stat"):  # families.py: one(..., kind="gauge"), Stat(..., kind="counter")
        kinds = [k.value for k in call.keywords if k.arg == "kind"]
        position = 3 if fn == "one" else 2
        if len(call.args) > position:
            kinds.append(call.args[position])
        default = "gauge" if fn == "one" else "counter"
        return ast.literal_eval(kinds[0]) if kinds else default
    return CONSTRUCTORS.get(fn)


@cache
def exported() -> dict[str, str]:
    """Every family name the picker can export -> its kind (counter, gauge, histogram)."""
    from extproc.core import Endpoint, EndpointState
    from extproc.server.families import TABLES
    from extproc.server.llmd_metrics import LlmdMetrics, PoolView

    kinds: dict[str, str] = {}
    for table in TABLES:
        for stat in table.exported.values():
            kinds[stat.name] = stat.kind
    llmd = LlmdMetrics()
    fresh = EndpointState(is_stale=False, age_s=0.1)
    llmd.attach_pool(PoolView("pool", "ns", lambda: [Endpoint("10.0.0.1:8000")], lambda _: fresh))
    for family in llmd.collect():
        kinds[family.name] = family.type
    unknown = []
    for path in sorted((ROOT / "extproc").rglob("*.py")):
        if "_proto" in path.parts or "sim" in path.parts:  # the simulator's are vLLM's names
            continue
        source = path.read_text()
        if not re.search(PREFIX + "_", source):
            continue  # parse only the modules that can name a family
        tree = ast.parse(source)
        fstrings = [f for f in ast.walk(tree) if isinstance(f, ast.JoinedStr)]
        in_fstrings = {id(n) for f in fstrings for n in ast.walk(f)}
        found: dict[str, str | None] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and NAME.fullmatch(str(arg.value)):
                        found[arg.value] = _literal_kind(node, arg.value)
        for node in ast.walk(tree):
            literal = isinstance(node, ast.Constant) and isinstance(node.value, str)
            if literal and id(node) not in in_fstrings and NAME.fullmatch(node.value):
                kind = found.get(node.value) or kinds.get(node.value)
                if kind is None:
                    unknown.append(f"{path.relative_to(ROOT)}: {node.value}")
                else:
                    kinds[node.value] = kind
    assert unknown == [], "metric names built by a call CONSTRUCTORS does not know"
    return kinds


def expand(mention: str) -> list[str]:
    """`a_{b,c}_d` -> [a_b_d, a_c_d]."""
    m = re.search(r"\{([a-z0-9_,]+)\}", mention)
    if m is None:
        return [mention]
    head, tail = mention[: m.start()], mention[m.end() :]
    return [name for alt in m.group(1).split(",") for name in expand(head + alt + tail)]


def mentions(text: str) -> set[str]:
    return {name for m in MENTION.findall(text) for name in expand(m)}


def family_of(name: str) -> str | None:
    """The exported family a doc's series name belongs to (its suffix as its kind allows)."""
    kinds = exported()
    for suffix in ("", "_total", "_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix) if suffix else name
        if name.endswith(suffix) and base in kinds and suffix in SUFFIXES[kinds[base]]:
            return base
    return None


def _unsuffixed(name: str) -> str:
    for suffix in ("_total", "_bucket", "_sum", "_count"):
        name = name.removesuffix(suffix)
    return name


@cache
def not_exported() -> tuple[str, ...]:
    """What docs/llm-d.md says extproc does not export, as glob patterns of family names: its
    table's first column (`*_request_output_tokens`; `_request_itl_seconds` continues the
    llm-d name before it)."""
    text = section(doc_texts()["llm-d.md"], NOT_EXPORTED_HEADING)
    spans = [s for cells in table_rows(text, ("llm-d / GIE family",)) for s in code_spans(cells[0])]
    return tuple(_unsuffixed(("*" if s.startswith("_") else "") + s) for s in spans)


def is_not_exported(name: str) -> bool:
    """A name, or the prefix a mention like `llm_d_epp_datalayer_*` stops at, that
    llm-d.md's table lists."""
    if name.endswith("*"):
        return any(p.startswith(name.rstrip("*")) for p in not_exported())
    return any(fnmatch.fnmatchcase(_unsuffixed(name), p) for p in not_exported())


def test_the_walk_finds_the_families():
    kinds = exported()
    assert len(kinds) > 250, len(kinds)
    assert kinds["extproc_requests"] == "counter"  # a prometheus_client Counter
    assert kinds["extproc_decision_seconds"] == "histogram"
    assert kinds["extproc_flow_queue_requests"] == "gauge"  # flow control's collector
    assert kinds["extproc_shared_inflight_degraded"] == "gauge"
    assert kinds["extproc_kv_events_messages"] == "counter"  # an f-string in a table
    assert kinds["llm_d_epp_std_dev_queue_size"] == "gauge"  # fresh pool figures only


@pytest.mark.parametrize("doc", sorted(doc_texts()))
def test_every_metric_a_doc_names_is_exported(doc: str):
    """A name with its series suffix (`_total` for a counter, none for a gauge, `_bucket` ...
    for a histogram); a prefix (`extproc_flow_*`) some family has."""
    wrong = []
    for name in sorted(mentions(doc_texts()[doc])):
        if name in NOT_METRICS or is_not_exported(name):
            continue
        if name.endswith("*"):
            if not any(f.startswith(name.rstrip("*")) for f in exported()):
                wrong.append(name)
        elif family_of(name) is None:
            base = _unsuffixed(name)
            kind = exported().get(base)
            wrong.append(f"{name} (a {kind}: write {base}{min(SUFFIXES[kind])})" if kind else name)
    assert wrong == []


def test_what_llmd_doc_says_is_not_exported_is_not():
    patterns = not_exported()
    assert "inference_extension_model_rewrite_decisions" in patterns  # the section parses
    assert "*_flow_control_*" in patterns
    for pattern in patterns:
        assert fnmatch.filter(exported(), pattern) == [], pattern


def test_the_not_metrics_are_what_the_reason_says():
    from extproc.bootstrap import BootstrapOptions

    fields = {f.name for f in dataclasses.fields(BootstrapOptions)}
    assert set(NOT_METRICS) <= fields
    assert not set(NOT_METRICS) & set(exported())


def _home(family: str) -> str:
    if family.startswith("extproc_flow_"):
        return "flow-control.md"
    return "operations.md" if family.startswith("extproc_") else "llm-d.md"


def test_every_family_is_documented_in_its_list():
    by_doc = {doc: {family_of(n) for n in mentions(text)} for doc, text in doc_texts().items()}
    missing = [
        f"{family} ({_home(family)})"
        for family in sorted(exported())
        if family not in by_doc[_home(family)] and family not in UNDOCUMENTED
    ]
    assert missing == []
    assert not set(UNDOCUMENTED) - set(exported()), "an excused family that is gone"


TYPE_COLUMNS = {  # doc -> (its metric tables' header, the type column)
    "operations.md": (("Metric", "Type"), 1),
    "flow-control.md": (("Metric", "Type"), 1),
    "llm-d.md": (("llm-d name", "GIE name", "type"), 2),
}


@pytest.mark.parametrize("doc", sorted(TYPE_COLUMNS))
def test_the_type_column_says_the_kind(doc: str):
    header, column = TYPE_COLUMNS[doc]
    rows = table_rows(doc_texts()[doc], header)
    assert len(rows) > 10
    wrong = []
    for cells in rows:
        # "counter", "counter, gauge", "histogram, llm-d's 5 ms..1 h buckets", "gauge (1)"
        kinds = set(re.findall(r"\b(counter|gauge|histogram)\b", cells[column]))
        assert kinds, cells[column]
        for name in mentions(" ".join(cells[:column])):
            family = family_of(name)
            if family is not None and exported()[family] not in kinds:
                wrong.append(f"{name}: {cells[column]}, is a {exported()[family]}")
    assert wrong == []
