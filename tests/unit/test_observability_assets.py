"""The Grafana dashboard and the Prometheus alerts parse, and query only metrics that exist."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client import CollectorRegistry

from controller.admin.metrics import Metrics
from controller.admission.gate import AdmissionGate
from policies.static import StaticPolicy
from tests.assets import (
    ALERTS,
    alert_exprs,
    alert_rules,
    autopilot_metric_names,
    dashboard_exprs,
    dashboard_panels,
    exposed_names,
    load_dashboard,
    metric_names,
    vllm_metric_names,
    vllm_source_metric_names,
)
from tests.helpers import EngineKnobsInForce, PolicyHolder


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("autopilot_engine_up == 0", {"autopilot_engine_up"}),
        (
            'increase(autopilot_config_reloads_total{result="error"}[10m]) > 0',
            {"autopilot_config_reloads_total"},
        ),
        (
            "histogram_quantile(0.99, sum by (instance, le) "
            '(rate(vllm:time_to_first_token_seconds_bucket{instance=~"$instance"}[$__rate_interval])))',
            {"vllm:time_to_first_token_seconds_bucket"},
        ),
        ("changes(autopilot_engine_generation[15m]) > 1", {"autopilot_engine_generation"}),
        (
            "max by (instance) (vllm:kv_cache_usage_perc) > 0.95"
            " and on (instance) rate(vllm:num_preemptions_total[5m]) > 0",
            {"vllm:kv_cache_usage_perc", "vllm:num_preemptions_total"},
        ),
        ("sum(rate(a_total[5m] offset 1h)) by (job) / ignoring(x) group_left b", {"a_total", "b"}),
        ("rate (x[1m]) * 1e3 + deriv(y[10m:1m]) - inf", {"x", "y"}),
        ('absent(up{job="vllm:1"})', {"up"}),
    ],
)
def test_metric_names(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_dashboard_is_valid_grafana_json() -> None:
    d = load_dashboard()
    assert d["uid"] == "vllm-autopilot"
    panels = list(dashboard_panels(d))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}"
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
    for expr in dashboard_exprs():
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        assert metric_names(expr), expr


def test_dashboard_shows_the_knobs_against_the_engine() -> None:
    used = autopilot_metric_names() | vllm_metric_names()
    for name in (
        "autopilot_admission_limit",
        "autopilot_max_num_active_seqs",
        "autopilot_queue_depth",
        "autopilot_decisions_total",
        "autopilot_engine_generation",
        "autopilot_config_reloads_total",
        "autopilot_rejected_requests_total",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
    ):
        assert name in used, name
    exprs = "\n".join(dashboard_exprs())
    assert "histogram_quantile(0.99" in exprs


def test_alerts_are_well_formed() -> None:
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}, rule[
            "alert"
        ]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert rule["annotations"]["summary"].strip() and rule["annotations"]["description"].strip()
        assert metric_names(str(rule["expr"])), rule["alert"]


def test_alerts_watch_engine_down_reload_errors_restarts_kv_preemptions_queue_and_refusals() -> None:
    by_name = {r["alert"]: r for r in alert_rules()}
    assert by_name["AutopilotEngineDown"]["expr"] == "autopilot_engine_up == 0"
    assert by_name["AutopilotEngineDown"]["for"] == "1m"
    assert 'increase(autopilot_config_reloads_total{result="error"}[10m]) > 0' in alert_exprs()
    assert "changes(autopilot_engine_generation[15m]) > 1" in alert_exprs()
    kv = metric_names(by_name["AutopilotKVCacheFullWithPreemptions"]["expr"])
    assert kv == {"vllm:kv_cache_usage_perc", "vllm:num_preemptions_total"}
    assert "autopilot_queue_depth" in metric_names(by_name["AutopilotQueueGrowing"]["expr"])
    assert "autopilot_rejected_requests_total" in metric_names(by_name["AutopilotRejectingRequests"]["expr"])


def test_every_autopilot_metric_used_is_exported() -> None:
    exported = exposed_names(Metrics(CollectorRegistry()).registry)
    assert "autopilot_decisions_total" in exported and "autopilot_decisions" not in exported
    unknown = autopilot_metric_names() - exported
    assert not unknown, f"queried but not exported by controller.admin.metrics: {sorted(unknown)}"


def test_only_autopilot_and_vllm_metrics_are_used() -> None:
    used = {n for expr in dashboard_exprs() + alert_exprs() for n in metric_names(expr)}
    assert used == autopilot_metric_names() | vllm_metric_names()


def test_every_vllm_metric_used_is_defined_by_vllm() -> None:
    defined = vllm_source_metric_names()
    if defined is None:
        pytest.skip("vLLM is not installed")
    assert "vllm:num_preemptions_total" in defined  # the parser reads vLLM's counters right
    unknown = vllm_metric_names() - defined
    assert not unknown, f"not defined in vllm/v1/metrics/loggers.py: {sorted(unknown)}"


def test_promtool_accepts_the_rules() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed")
    result = subprocess.run(
        [promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


ENGINE = EngineKnobsInForce(batch_cap=12, max_num_seqs=16, generation=2)


def test_gauges_are_read_at_scrape_time() -> None:
    metrics = Metrics(CollectorRegistry())
    gate = AdmissionGate(4, 100)
    holder = PolicyHolder(StaticPolicy(max_num_seqs=16, initial_limit=4, preset="interactive"))
    metrics.live.read_from(gate, ENGINE, holder)
    value = metrics.registry.get_sample_value
    assert value("autopilot_admission_limit") == 4
    gate.set_limit(9)  # no refresh step: the next scrape sees it
    assert value("autopilot_admission_limit") == 9
    assert (value("autopilot_max_num_active_seqs"), value("autopilot_max_num_seqs")) == (12, 16)
    assert value("autopilot_max_num_scheduled_tokens") == 512
    assert (value("autopilot_engine_generation"), value("autopilot_engine_up")) == (2, 1)
    assert value("autopilot_in_flight_requests") == 0
    assert value("autopilot_queue_depth", {"priority_class": gate.classes[0].name}) == 0
