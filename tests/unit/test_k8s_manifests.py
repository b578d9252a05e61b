"""deploy/k8s/: every manifest parses, passes the Kubernetes (kubernetes-validate, strict) or KEDA
schema, and the manifests agree with one another and with the daemon (ports, probes, the mounted
config file, the drain time, the metric the autoscalers read).
"""

from __future__ import annotations

import copy
import importlib.resources
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry
from referencing import Registry, Resource

from controller.admin.metrics import Metrics
from tests.assets import exposed_names

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KEDA_SCHEMA = ROOT / "tests" / "schemas" / "keda-scaledobject-v1alpha1.json"
KUBERNETES = "1.33"  # the oldest minor the manifests use a field of (preStop sleep is beta since 1.30)
SATURATION = "autopilot_saturation"


def _manifests() -> dict[str, dict[str, Any]]:
    """Every object in deploy/k8s by kind (one object per kind there)."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["kind"] not in out, f"{path.name}: a second {doc['kind']}"
            out[doc["kind"]] = doc
    return out


M = _manifests()


def _keda_validator() -> jsonschema.protocols.Validator:
    folder = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
    definitions = json.loads((folder / f"v{KUBERNETES}.0-local-strict" / "_definitions.json").read_text())
    schema = json.loads(KEDA_SCHEMA.read_text())
    registry: Registry[Any] = Resource.from_contents(definitions) @ Registry()
    return jsonschema.Draft202012Validator(schema, registry=registry)


def _validate(doc: dict[str, Any]) -> None:
    if doc["apiVersion"].startswith("keda.sh/"):
        _keda_validator().validate(doc)
    else:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_manifests_are_the_expected_set() -> None:
    assert set(M) == {
        "Namespace",
        "ConfigMap",
        "Deployment",
        "Service",
        "ScaledObject",
        "HorizontalPodAutoscaler",
    }


@pytest.mark.parametrize("kind", sorted(M))
def test_each_manifest_passes_its_schema(kind: str) -> None:
    _validate(M[kind])


def test_the_schemas_refuse_a_wrong_field() -> None:
    """The checks are real: strict schemas refuse an unknown field, a wrong type, a number where KEDA
    takes a string."""
    deployment = copy.deepcopy(M["Deployment"])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(deployment)
    hpa = copy.deepcopy(M["HorizontalPodAutoscaler"])
    hpa["spec"]["minReplicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(hpa)
    keda = copy.deepcopy(M["ScaledObject"])
    keda["spec"]["triggers"][0]["metadata"]["threshold"] = 0.8
    with pytest.raises(jsonschema.ValidationError):
        _validate(keda)
    keda = copy.deepcopy(M["ScaledObject"])
    keda["spec"]["minReplicas"] = 1  # the HPA's name, not KEDA's
    with pytest.raises(jsonschema.ValidationError):
        _validate(keda)


def _pod() -> dict[str, Any]:
    spec: dict[str, Any] = M["Deployment"]["spec"]["template"]["spec"]
    return spec


def _container() -> dict[str, Any]:
    (container,) = _pod()["containers"]
    return dict(container)


def _ports() -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in _container()["ports"]}


def test_the_service_selects_the_deployments_pods_and_its_ports_exist() -> None:
    template = M["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert M["Deployment"]["spec"]["selector"]["matchLabels"].items() <= template.items()
    assert M["Service"]["spec"]["selector"].items() <= template.items()
    assert {p["targetPort"] for p in M["Service"]["spec"]["ports"]} <= set(_ports())
    assert {"http", "metrics"} <= set(_ports())  # the data plane and the port scrapers find by name


def test_probes_use_named_ports_readiness_on_healthz_liveness_not() -> None:
    c = _container()
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in _ports(), probe
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"
    # /healthz is 503 during an engine restart: a liveness probe there would kill a recovering pod
    assert c["livenessProbe"]["httpGet"]["path"] != "/healthz"
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # a model build takes minutes
    assert c["resources"]["limits"]["nvidia.com/gpu"] >= 1
    annotations = M["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == _ports()["metrics"]


def _config_text() -> str:
    return str(M["ConfigMap"]["data"]["config.toml"])


def test_the_configmap_key_is_the_file_the_daemon_reads() -> None:
    """ConfigMap key -> template mount -> init container (token in) -> shared emptyDir -> --config."""
    pod = _pod()
    volumes = {v["name"]: v for v in pod["volumes"]}
    (init,) = pod["initContainers"]
    template_mount = next(m for m in init["volumeMounts"] if "configMap" in volumes[m["name"]])
    source = volumes[template_mount["name"]]["configMap"]
    assert source["name"] == M["ConfigMap"]["metadata"]["name"]
    assert [item["key"] for item in source["items"]] == ["config.toml"]
    *_, script, src, dst = init["command"]
    assert src == f"{template_mount['mountPath']}/config.toml"
    command = _container()["command"]
    assert command[command.index("--config") + 1] == dst
    init_mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    main_mounts = {m["name"]: m["mountPath"] for m in _container()["volumeMounts"]}
    shared = init_mounts.keys() & main_mounts.keys()
    assert any(dst.startswith(init_mounts[n] + "/") and init_mounts[n] == main_mounts[n] for n in shared)
    assert all(
        "emptyDir" in volumes[n] for n in shared
    )  # the rendered file (with the token) stays in the pod
    assert init["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "vllm-autopilot-admin", "key": "token"}
    assert "@ADMIN_TOKEN@" in _config_text() and "@ADMIN_TOKEN@" in script


def test_the_config_matches_the_ports_and_the_grace_period_covers_the_drain() -> None:
    config = tomllib.loads(_config_text())
    assert config["server"]["port"] == _ports()["http"] and config["admin"]["port"] == _ports()["metrics"]
    assert config["server"]["host"] == config["admin"]["host"] == "0.0.0.0"
    pre_stop = _container()["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = pre_stop + config["server"]["shutdown_timeout_s"]
    assert _pod()["terminationGracePeriodSeconds"] > drain + 10  # + the engine's own stop


def test_the_config_in_the_configmap_loads(tmp_path: Path) -> None:
    """check-config's own validation (vLLM's argument names and bounds included) on the shipped file."""
    from controller.config.load import load_config

    path = tmp_path / "config.toml"
    path.write_text(_config_text().replace("@ADMIN_TOKEN@", "t" * 32))
    config = load_config(path)
    assert config.admin.token == "t" * 32 and config.server.port == _ports()["http"]
    assert config.slo is not None  # autopilot_saturation is measured against the [slo] bounds


def _queries() -> list[str]:
    return [t["metadata"]["query"] for t in M["ScaledObject"]["spec"]["triggers"]]


def test_both_autoscalers_target_the_deployment_and_read_saturation() -> None:
    for kind in ("ScaledObject", "HorizontalPodAutoscaler"):
        ref = M[kind]["spec"]["scaleTargetRef"]
        assert (ref["kind"], ref["name"]) == ("Deployment", M["Deployment"]["metadata"]["name"])
    assert all(re.search(rf"\b{SATURATION}\b", q) for q in _queries())
    (metric,) = M["HorizontalPodAutoscaler"]["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == SATURATION
    # the same target: 0.8 of a replica's SLO capacity
    assert M["ScaledObject"]["spec"]["triggers"][0]["metadata"]["threshold"] == "0.8"
    assert metric["pods"]["target"]["averageValue"] == "800m"


def test_the_metric_the_autoscalers_read_is_one_we_export() -> None:
    names = exposed_names(_registry())
    assert SATURATION in names and "autopilot_capacity_rps" in names


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Metrics(registry)
    return registry
