"""The vLLM metrics that routers read (llm-d's scorers, the Gateway API inference extension's endpoint
picker: queue depth and KV-cache use per replica) are served on the control plane's /metrics under
vLLM's own names, beside ours.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import REGISTRY, CollectorRegistry, Gauge

from controller.admin.server import make_admin_app
from tests.assets import vllm_source_metric_names

ROUTER_METRICS = ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def test_vllm_defines_the_router_metrics_under_these_names() -> None:
    names = vllm_source_metric_names()
    if names is None:
        pytest.skip("vLLM is not installed")
    assert set(ROUTER_METRICS) <= names


@pytest.fixture
def vllm_gauges() -> Iterator[list[Gauge]]:
    """Gauges by vLLM's names in prometheus_client's default registry, where vLLM's stat logger puts
    them; removed afterwards (the registry is process-wide)."""
    gauges = [Gauge(name, "as vLLM", ["model_name", "engine"], registry=REGISTRY) for name in ROUTER_METRICS]
    try:
        yield gauges
    finally:
        for gauge in gauges:
            REGISTRY.unregister(gauge)


async def _unused() -> dict[str, object]:
    return {"ok": True}


async def test_the_control_plane_serves_them_under_their_names(vllm_gauges: list[Gauge]) -> None:
    waiting, kv = vllm_gauges
    waiting.labels("tiny", "0").set(3)
    kv.labels("tiny", "0").set(0.25)
    app = make_admin_app(CollectorRegistry(), dict, lambda: (True, "serving"), _unused, token="secret")
    async with TestClient(TestServer(app)) as client:
        response = await client.get("/metrics")  # no token: scrapers read /metrics openly
        assert response.status == 200
        text = await response.text()
    assert 'vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0' in text
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25' in text
