"""deploy/k8s/: every manifest parses, passes the Kubernetes (kubernetes-validate, strict) or KEDA
schema, and the manifests agree with one another and with the daemon (ports, probes, the mounted
config file, the drain time, the metric the autoscalers read). The pod is hardened: non-root, no
privilege escalation, no capabilities, seccomp RuntimeDefault, a read-only root with a volume under
every path the daemon writes, secrets from Secrets (the admin token written as a TOML string), a
NetworkPolicy, liveness on the restart budget, a rollout that needs no spare GPU. The router of the
fleet (router.yaml, vllm-router) discovers the daemons by their label on their data-plane port, with
the flags docs/fleet.md recommends, read by the router's own parser; its pod is hardened the same way
and its account may only watch pods of the namespace.
"""

from __future__ import annotations

import copy
import importlib.resources
import json
import os
import re
import stat
import subprocess
import sys
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
from controller.admin.server import BEYOND_RECOVERY, make_admin_app
from tests.assets import exposed_names

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KEDA_SCHEMA = ROOT / "tests" / "schemas" / "keda-scaledobject-v1alpha1.json"
KUBERNETES = "1.33"  # the oldest minor the manifests use a field of (preStop sleep is beta since 1.30)
SATURATION = "autopilot_saturation"


ROUTER_FILE = "router.yaml"


def _manifests(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """Every object in ``paths`` by kind (one object per kind there)."""
    out: dict[str, dict[str, Any]] = {}
    for path in paths:
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["kind"] not in out, f"{path.name}: a second {doc['kind']}"
            out[doc["kind"]] = doc
    return out


M = _manifests([p for p in sorted(K8S.glob("*.yaml")) if p.name != ROUTER_FILE])
"""The daemons' objects."""
R = _manifests([K8S / ROUTER_FILE])
"""The router's objects."""


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
        "NetworkPolicy",
    }


@pytest.mark.parametrize("kind", sorted(M))
def test_each_manifest_passes_its_schema(kind: str) -> None:
    _validate(M[kind])


@pytest.mark.parametrize("kind", sorted(R))
def test_each_router_manifest_passes_its_schema(kind: str) -> None:
    _validate(R[kind])


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
    keda = copy.deepcopy(M["ScaledObject"])
    keda["spec"]["triggers"][0]["metadata"]["metricName"] = SATURATION  # removed in KEDA 2.12
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


# -- hardening ------------------------------------------------------------------------------------


def _all_containers() -> list[dict[str, Any]]:
    return [*_pod()["initContainers"], *_pod()["containers"]]


def _effective_security(container: dict[str, Any]) -> dict[str, Any]:
    """The pod's securityContext with the container's own laid over it (Kubernetes' precedence)."""
    return {**_pod().get("securityContext", {}), **container.get("securityContext", {})}


@pytest.mark.parametrize("name", [c["name"] for c in _all_containers()])
def test_every_container_runs_non_root_without_privileges(name: str) -> None:
    (container,) = [c for c in _all_containers() if c["name"] == name]
    security = _effective_security(container)
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] != 0 and security.get("runAsGroup", 1) != 0
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert "add" not in security["capabilities"]
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert security["readOnlyRootFilesystem"] is True
    assert security.get("privileged", False) is False
    assert _pod()["automountServiceAccountToken"] is False  # the daemon never calls the API server


WRITTEN_PATHS = (
    "HOME",
    "STATE_DIRECTORY",
    "XDG_CACHE_HOME",
    "HF_HOME",
    "VLLM_CACHE_ROOT",
    "TRITON_CACHE_DIR",
    "TORCHINDUCTOR_CACHE_DIR",
    "CUDA_CACHE_PATH",
    "TMPDIR",
)
"""Where the daemon, vLLM, Hugging Face, torch.compile, Triton and CUDA write: the warm-up fits
(``lifecycle/warm.state_dir``), the model download, the compile caches, temporary files."""


def _env() -> dict[str, Any]:
    return {e["name"]: e for e in _container()["env"]}


def _writable_mounts(container: dict[str, Any]) -> list[str]:
    volumes = {v["name"]: v for v in _pod()["volumes"]}
    mounts = [m for m in container["volumeMounts"] if not m.get("readOnly", False)]
    assert all("emptyDir" in volumes[m["name"]] for m in mounts)  # nothing of the host's is written
    return [m["mountPath"] for m in mounts]


def _under(path: str, mounts: list[str]) -> bool:
    return any(path == m or path.startswith(m + "/") for m in mounts)


def test_every_path_the_daemon_writes_is_a_writable_volume_under_the_read_only_root() -> None:
    env, writable = _env(), _writable_mounts(_container())
    for name in WRITTEN_PATHS:
        assert _under(env[name]["value"], writable), f"{name}={env[name]['value']} is on the read-only root"
    # Python's tempfile (the logging config handed to vLLM) and vLLM's ZMQ ipc:// sockets, whatever
    # TMPDIR says; the engine's shared-memory queues
    assert {"/tmp", "/dev/shm"} <= set(writable)
    config = next(m for m in _container()["volumeMounts"] if m["mountPath"] == "/etc/vllm-autopilot")
    assert config["readOnly"] is True  # the daemon reads its config, never writes it
    (init,) = _pod()["initContainers"]
    *_, dst = init["command"]
    assert _under(dst, _writable_mounts(init))


def test_the_data_plane_key_comes_from_a_secret() -> None:
    key = _env()["VLLM_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"] == {"name": "vllm-autopilot-api", "key": "key"}
    assert "value" not in key
    # an [server] api_key in the file would win over VLLM_API_KEY and put a secret in the ConfigMap
    assert "api_key" not in tomllib.loads(_config_text()).get("server", {})


def test_liveness_is_the_probe_that_fails_once_the_restart_budget_is_spent_or_the_loop_stalls() -> None:
    liveness = _container()["livenessProbe"]
    assert liveness["httpGet"] == {"path": "/livez", "port": "metrics"}
    app = make_admin_app(CollectorRegistry(), dict, lambda: (True, "serving"), _no_reload)
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource is not None}
    assert ("GET", "/livez") in routes
    # a stalled control loop is the signal the systemd watchdog acts on: the kubelet's too
    assert {"restart_budget_spent", "control_loop_stalled"} == BEYOND_RECOVERY
    # the kubelet restarts such a pod within a minute
    assert liveness["periodSeconds"] * liveness["failureThreshold"] == 60


async def _no_reload() -> dict[str, Any]:
    raise AssertionError("not called")


def test_a_rollout_needs_no_spare_gpu() -> None:
    strategy = M["Deployment"]["spec"]["strategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


TOKENS = [
    "t" * 32,
    'quote"inside',
    "back\\slash\\",
    'end"\nlimit = 1\n[admin]\ntoken = "mine',  # a token that tries to close the string and add keys
    "\\u0041 is not A",
    "tab\tand\x7fdel\x01",
    "ключ-🔑",
    "@ADMIN_TOKEN@",
]


@pytest.mark.parametrize("token", TOKENS)
def test_the_admin_token_is_written_into_toml_as_a_string(tmp_path: Path, token: str) -> None:
    """The init container's own script, run on the ConfigMap's file: the token read back is the token,
    and nothing else in the file changed."""
    (init,) = _pod()["initContainers"]
    python, flag, script, _, _ = init["command"]
    assert (python, flag) == ("python3", "-c")
    template, rendered = tmp_path / "template.toml", tmp_path / "config.toml"
    template.write_text(_config_text(), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-c", script, str(template), str(rendered)],
        env={**os.environ, "ADMIN_TOKEN": token},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    config = tomllib.loads(rendered.read_text(encoding="utf-8"))
    assert config["admin"]["token"] == token
    expected = tomllib.loads(_config_text())
    expected["admin"]["token"] = token
    assert config == expected
    assert stat.S_IMODE(rendered.stat().st_mode) == 0o600  # readable by the daemon's user only


def test_the_token_script_refuses_a_template_without_its_placeholder(tmp_path: Path) -> None:
    (init,) = _pod()["initContainers"]
    script = init["command"][2]
    template = tmp_path / "template.toml"
    template.write_text('[admin]\ntoken = ""\n', encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-c", script, str(template), str(tmp_path / "out.toml")],
        env={**os.environ, "ADMIN_TOKEN": "t"},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 1 and "expected one" in result.stderr
    assert not (tmp_path / "out.toml").exists()


def test_the_network_policy_admits_only_the_pods_two_ports() -> None:
    policy = M["NetworkPolicy"]["spec"]
    labels = M["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert set(policy["policyTypes"]) == {"Ingress", "Egress"}
    opened = [(p["port"], p["protocol"]) for rule in policy["ingress"] for p in rule["ports"]]
    assert sorted(opened) == [("http", "TCP"), ("metrics", "TCP")]
    assert all(port in _ports() for port, _ in opened)  # named ports the container declares
    metrics_rule = next(r for r in policy["ingress"] if r["ports"][0]["port"] == "metrics")
    # where the ScaledObject's Prometheus lives
    server = M["ScaledObject"]["spec"]["triggers"][0]["metadata"]["serverAddress"]
    namespace = metrics_rule["from"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
    assert f".{namespace}.svc" in server
    egress = sorted((p["port"], p["protocol"]) for rule in policy["egress"] for p in rule["ports"])
    assert egress == [(53, "TCP"), (53, "UDP"), (443, "TCP")]


# -- the router ------------------------------------------------------------------------------------


def _router_pod() -> dict[str, Any]:
    spec: dict[str, Any] = R["Deployment"]["spec"]["template"]["spec"]
    return spec


def _router_container() -> dict[str, Any]:
    (container,) = _router_pod()["containers"]
    return dict(container)


def _router_args() -> Any:
    """The router's command line as its own parser reads it (the ``fleet`` extra's wheel)."""
    launcher = pytest.importorskip(
        "vllm_router.launch_router",
        reason="vllm-router is not installed: pip install 'vllm-autopilot[fleet]'",
    )
    container = _router_container()
    assert container["command"] == ["vllm-router"]
    return launcher.parse_router_args(container["args"])


def test_the_router_manifests_are_the_expected_set() -> None:
    assert set(R) == {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding"}
    namespace = M["Namespace"]["metadata"]["name"]
    assert {doc["metadata"]["namespace"] for doc in R.values()} == {namespace}


def test_the_router_discovers_the_daemons_by_label_on_their_data_plane() -> None:
    args = _router_args()
    daemon_labels = M["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert args.service_discovery is True and args.worker_urls == []
    assert args.selector and args.selector.items() <= daemon_labels.items()
    assert args.service_discovery_namespace == M["Deployment"]["metadata"]["namespace"]
    assert args.service_discovery_port == _ports()["http"]
    router_labels = R["Deployment"]["spec"]["template"]["metadata"]["labels"]
    # the router must not discover itself, nor be an endpoint of the daemons' Service
    assert not args.selector.items() <= router_labels.items()
    assert not M["Service"]["spec"]["selector"].items() <= router_labels.items()


def test_the_router_retries_a_refusal_on_another_replica() -> None:
    """docs/fleet.md: round_robin moves a 429 or 503 to the next replica; three 503s in a row (a
    daemon recovering, draining or out of restarts) take a replica out for a while."""
    args = _router_args()
    assert args.policy == "round_robin"
    assert not args.disable_retries and args.retry_max_retries > 1
    assert not args.disable_circuit_breaker and args.cb_failure_threshold < args.retry_max_retries
    assert args.host == "0.0.0.0" and args.prometheus_host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in _router_container()["ports"]}
    assert (args.port, args.prometheus_port) == (ports["http"], ports["metrics"])


def test_the_router_service_and_probes_use_its_ports() -> None:
    ports = {p["name"] for p in _router_container()["ports"]}
    labels = R["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert R["Deployment"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert R["Service"]["spec"]["selector"].items() <= labels.items()
    assert {p["targetPort"] for p in R["Service"]["spec"]["ports"]} <= ports
    c = _router_container()
    assert c["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": "http"}


def test_the_router_may_only_watch_pods_in_its_namespace() -> None:
    pod = _router_pod()
    account = R["ServiceAccount"]["metadata"]["name"]
    assert pod["serviceAccountName"] == account and pod["automountServiceAccountToken"] is True
    (rule,) = R["Role"]["rules"]
    assert rule == {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    binding = R["RoleBinding"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "vllm-router",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": R["ServiceAccount"]["metadata"]["namespace"]}
    ]


def test_the_router_runs_non_root_without_privileges_on_a_read_only_root() -> None:
    container = _router_container()
    security = {**_router_pod()["securityContext"], **container["securityContext"]}
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert security["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in _router_pod()["volumes"]}
    writable = [m for m in container["volumeMounts"] if not m.get("readOnly", False)]
    assert [m["mountPath"] for m in writable] == ["/tmp"]
    assert all("emptyDir" in volumes[m["name"]] for m in writable)


def test_the_network_policy_lets_the_router_reach_the_data_plane() -> None:
    policy = M["NetworkPolicy"]
    assert policy["metadata"]["namespace"] == R["Deployment"]["metadata"]["namespace"]
    http_rule = next(r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == "http")
    router_labels = R["Deployment"]["spec"]["template"]["metadata"]["labels"]
    selectors = [
        peer["podSelector"].get("matchLabels", {}) for peer in http_rule["from"] if "podSelector" in peer
    ]
    assert any(selector.items() <= router_labels.items() for selector in selectors)


def _scale_up_minutes(behavior: dict[str, Any], start: int, target: int) -> int:
    """Minutes the HPA takes from ``start`` to ``target`` replicas under ``behavior``'s scale-up
    policies, each period allowing what the policy ``selectPolicy`` picks (Kubernetes' rule: Pods adds
    ``value`` pods, Percent ``ceil(current * value / 100)``)."""
    up = behavior["scaleUp"]
    assert all(p["periodSeconds"] == 60 for p in up["policies"])
    pick = max if up.get("selectPolicy", "Max") == "Max" else min
    n, minutes = start, 0
    while n < target:
        steps = [p["value"] if p["type"] == "Pods" else -(-n * p["value"] // 100) for p in up["policies"]]
        n, minutes = min(target, n + pick(steps)), minutes + 1
    return minutes


@pytest.mark.parametrize("kind", ["HorizontalPodAutoscaler", "ScaledObject"])
def test_scale_up_grows_with_the_fleet(kind: str) -> None:
    """2 pods a minute for a small fleet, half the fleet a minute for a large one (docs/fleet.md)."""
    spec = M[kind]["spec"]
    behavior = (
        spec["behavior"]
        if kind == "HorizontalPodAutoscaler"
        else spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    )
    assert _scale_up_minutes(behavior, 1, 3) == 1  # Pods 2 beats 50 % of 1
    assert _scale_up_minutes(behavior, 10, 100) == 6  # 10, 15, 23, 35, 53, 80, 100
