"""The observability assets (Grafana dashboard, Prometheus alerts) and the metric names they query.

``vllm_metric_names()`` is for the integration tests: every name it returns must appear in a live
``/metrics`` scrape of the daemon once the engine has served a request (histograms and counters only
show up after their first observation).
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "vllm-autopilot.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"

# Aggregation operators, functions and keywords of PromQL: never metric names.
PROMQL_WORDS = frozenset(
    """
    sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk limit_ratio
    by without on ignoring group_left group_right bool offset and or unless atan2 inf nan start end
    abs absent absent_over_time ceil changes clamp clamp_max clamp_min day_of_month day_of_week
    day_of_year days_in_month delta deriv exp floor histogram_avg histogram_count histogram_fraction
    histogram_quantile histogram_stddev histogram_stdvar histogram_sum holt_winters
    double_exponential_smoothing
    hour idelta increase irate label_join label_replace ln log2 log10 minute month predict_linear rate resets
    round scalar sgn sort sort_desc sort_by_label sort_by_label_desc sqrt time timestamp vector year
    avg_over_time min_over_time max_over_time sum_over_time count_over_time quantile_over_time
    stddev_over_time stdvar_over_time last_over_time present_over_time mad_over_time
    acos acosh asin asinh atan atanh cos cosh sin sinh tan tanh deg rad pi
    """.split()
)

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*+)(?!\s*\()")  # possessive: no shorter match


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (Grafana's ``$variables`` allowed)."""
    s = _STRING.sub('""', expr)
    s = re.sub(r"\{[^}]*\}", "{}", s)  # label matchers: label names and values are not metrics
    s = re.sub(r"\[[^\]]*\]", "[]", s)  # ranges and subqueries: durations
    s = _GROUPING.sub(" ", s)  # by (le), on (instance): label lists
    s = re.sub(r"\boffset\s+-?\w+", " ", s)
    s = re.sub(r"\$\{[^}]*\}|\$\w+", " ", s)
    return {m for m in _IDENT.findall(s) if m not in PROMQL_WORDS}


def load_dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def load_alerts() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(ALERTS.read_text())
    return data


def dashboard_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows hold their panels


def dashboard_exprs() -> list[str]:
    d = load_dashboard()
    exprs = [t["expr"] for p in dashboard_panels(d) for t in p.get("targets", [])]
    exprs += [a["expr"] for a in d.get("annotations", {}).get("list", []) if "expr" in a]
    for var in d.get("templating", {}).get("list", []):
        query = var.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        found = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", text)
        if found:
            exprs.append(found.group(1))
    return exprs


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in load_alerts()["groups"] for rule in group["rules"]]


def alert_exprs() -> list[str]:
    return [str(rule["expr"]) for rule in alert_rules()]


def used_metric_names() -> set[str]:
    return {name for expr in dashboard_exprs() + alert_exprs() for name in metric_names(expr)}


def vllm_metric_names() -> set[str]:
    """The ``vllm:*`` series the dashboard and the alerts query, as exposed (``_total``, ``_bucket``)."""
    return {n for n in used_metric_names() if n.startswith("vllm:")}


def autopilot_metric_names() -> set[str]:
    return {n for n in used_metric_names() if n.startswith("autopilot_")}


_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
}


def exposed_names(registry: CollectorRegistry) -> set[str]:
    """Series names a registry exposes, labelled children or not (a Counter "x" is "x_total")."""
    out: set[str] = set()
    for family in registry.collect():
        out.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
        out.update(sample.name for sample in family.samples)
    return out


def vllm_source_metric_names() -> set[str] | None:
    """Series names vLLM's Prometheus stat logger defines, read from its source without importing
    vLLM (seconds); None when vLLM is not installed."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    source = (Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics" / "loggers.py").read_text()
    out: set[str] = set()
    for kind, name in re.findall(r"_(counter|gauge|histogram)_cls\(\s*name=\"(vllm:\w+)\"", source):
        out.update(name + suffix for suffix in _SUFFIXES[kind])
    return out
