"""Grafana dashboards' PromQL, read far enough to check it against a scrape: each target's
vector selectors (metric name + label matchers) and grouping labels, Grafana variables
substituted, and a Prometheus-like view of scraped series (target labels attached the way a
ServiceMonitor's scrape attaches them).

Not a PromQL engine: a query "finds data" when every selector in it matches at least one
scraped series, which is what makes a panel show something instead of "No data".
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

# PromQL words that look like metric names but are functions, aggregations or keywords.
_KEYWORDS = {
    "sum", "avg", "min", "max", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group", "by", "without", "on", "ignoring", "group_left", "group_right",
    "and", "or", "unless", "bool", "offset", "inf", "nan",
}  # fmt: skip
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?")
_MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
PICKER_PREFIXES = ("llm_d_epp_", "inference_objective_", "inference_pool_", "inference_extension_")


@dataclass(frozen=True)
class Selector:
    metric: str
    matchers: tuple[tuple[str, str, str], ...]

    def matches(self, name: str, labels: Mapping[str, str]) -> bool:
        if name != self.metric:
            return False
        for label, op, value in self.matchers:
            have = labels.get(label, "")
            ok = {
                "=": have == value,
                "!=": have != value,
                "=~": re.fullmatch(value, have) is not None,
                "!~": re.fullmatch(value, have) is None,
            }[op]
            if not ok:
                return False
        return True


@dataclass(frozen=True)
class Query:
    dashboard: str
    panel: str
    ref: str
    expr: str
    selectors: tuple[Selector, ...]
    grouping: tuple[str, ...]

    @property
    def about_picker(self) -> bool:
        return any(s.metric.startswith(PICKER_PREFIXES) for s in self.selectors)

    @property
    def label(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref}"


def parse_expr(expr: str) -> tuple[tuple[Selector, ...], tuple[str, ...]]:
    grouping = tuple(
        g.strip() for m in _GROUPING.finditer(expr) for g in m.group(1).split(",") if g.strip()
    )
    text = _RANGE.sub("", _GROUPING.sub("", expr))
    selectors = []
    for m in _SELECTOR.finditer(text):
        name, braces = m.group(1), m.group(2)
        rest = text[m.end() :].lstrip()
        if name in _KEYWORDS or (braces is None and rest.startswith("(")):
            continue
        if name[0].isdigit():
            continue
        matchers = tuple(
            (k, op, v.encode().decode("unicode_escape"))
            for k, op, v in _MATCHER.findall(braces or "")
        )
        selectors.append(Selector(name, matchers))
    return tuple(selectors), grouping


def _panels(panels: list[dict]) -> Iterator[dict]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))


def load_queries(path: Path, variables: Mapping[str, str]) -> list[Query]:
    """Every Prometheus target of a dashboard, `$var` / `${var}` replaced from `variables`."""
    doc = json.loads(path.read_text())
    title = doc["title"]
    out = []
    for panel in _panels(doc["panels"]):
        for target in panel.get("targets", []):
            expr = target.get("expr")
            if not expr:
                continue
            for name, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):
                expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
            selectors, grouping = parse_expr(expr)
            out.append(Query(title, panel["title"], target["refId"], expr, selectors, grouping))
    return out


@dataclass(frozen=True)
class Series:
    name: str
    labels: Mapping[str, str]
    value: float


def scrape_series(text: str, target: Mapping[str, str]) -> list[Series]:
    """Samples of an exposition as Prometheus stores them: target labels win, a clashing
    exported label is kept as `exported_<name>` (honorLabels: false, the default)."""
    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = dict(s.labels)
            for k in list(labels):
                if k in target:
                    labels[f"exported_{k}"] = labels.pop(k)
            labels.update(target)
            out.append(Series(s.name, labels, s.value))
    return out


def finds_data(q: Query, series: list[Series]) -> list[str]:
    """What is missing for `q` to show data (empty: it finds data)."""
    missing = []
    for sel in q.selectors:
        hits = [s for s in series if sel.matches(s.name, s.labels)]
        if not hits:
            missing.append(f"no series for {sel.metric}{dict((k, v) for k, _, v in sel.matchers)}")
            continue
        for g in q.grouping:
            if g != "le" and not any(g in s.labels for s in hits):
                missing.append(f"{sel.metric}: no label {g!r} to group by")
    return missing
