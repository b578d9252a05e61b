"""The vLLM metrics that routers read (llm-d's scorers, the Gateway API inference extension's endpoint
picker: queue depth and KV-cache use per replica) are served on the control plane's /metrics under
vLLM's own names, beside ours.
"""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import REGISTRY, CollectorRegistry, Gauge

from controller.admin.server import VLLM_REGISTRY, make_admin_app
from tests.assets import vllm_source_metric_names

ROUTER_METRICS = ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def test_vllm_defines_the_router_metrics_under_these_names() -> None:
    names = vllm_source_metric_names()
    if names is None:
        pytest.skip("vLLM is not installed")
    assert set(ROUTER_METRICS) <= names


def test_by_default_the_control_plane_serves_the_process_wide_registry() -> None:
    """vLLM's stat logger registers in prometheus_client's default registry."""
    app = make_admin_app(CollectorRegistry(), dict, lambda: (True, "serving"), _unused)
    assert app[VLLM_REGISTRY] is REGISTRY


async def _unused() -> dict[str, object]:
    return {"ok": True}


async def test_the_control_plane_serves_them_under_their_names() -> None:
    """A registry of its own: the process-wide one already holds vLLM's gauges once an engine ran in
    this process (the integration tests), and a name registers only once."""
    vllm_registry = CollectorRegistry()
    waiting, kv = (
        Gauge(name, "as vLLM", ["model_name", "engine"], registry=vllm_registry) for name in ROUTER_METRICS
    )
    waiting.labels("tiny", "0").set(3)
    kv.labels("tiny", "0").set(0.25)
    app = make_admin_app(
        CollectorRegistry(),
        dict,
        lambda: (True, "serving"),
        _unused,
        token="secret",
        vllm_registry=vllm_registry,
    )
    async with TestClient(TestServer(app)) as client:
        response = await client.get("/metrics")  # no token: scrapers read /metrics openly
        assert response.status == 200
        text = await response.text()
    assert 'vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0' in text
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25' in text
