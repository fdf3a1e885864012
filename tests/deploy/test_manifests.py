"""deploy/: every manifest parses, core kinds pass the Kubernetes schemas offline, our
InferencePool / Gateway API usage stays inside the v1 fields, every kustomization resolves,
and the picker's Deployment agrees with our CLI and defaults."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from extproc.bootstrap import BootstrapOptions, build_bootstrap, render_bootstrap
from extproc.config import ServerSettings, load_settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# The newest Kubernetes minor whose schemas kubernetes-validate ships that our kubectl also
# speaks; gRPC probes need >= 1.27.
K8S_VERSION = "1.32.0"
OVERLAYS = ["base", "overlays/gateway-api", "overlays/istio", "overlays/istio/envoyfilter",
            "overlays/envoy", "overlays/monitoring"]  # fmt: skip
CORE_GROUPS = {"v1", "apps/v1", "rbac.authorization.k8s.io/v1", "policy/v1",
               "networking.k8s.io/v1"}  # fmt: skip
NAMESPACE = "inference"

Obj = dict[str, Any]


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def load_docs(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


# --- a small kustomize: resources, patches, configMapGenerator, namespace ---------------------


def resolve(directory: Path, used: set[Path] | None = None) -> list[Obj]:
    """The objects a kustomization produces (enough of kustomize to check references):
    every resource exists, every patch targets an object, generator files exist."""
    used = set() if used is None else used
    kfile = directory / "kustomization.yaml"
    assert kfile.is_file(), f"{directory}: no kustomization.yaml"
    used.add(kfile)
    k = yaml.safe_load(kfile.read_text())
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    objs: list[Obj] = []
    for res in k.get("resources", []):
        target = (directory / res).resolve()
        assert target.exists(), f"{kfile}: resource {res} does not exist"
        if target.is_dir():
            objs += resolve(target, used)
        else:
            used.add(target)
            objs += load_docs(target)
    for gen in k.get("configMapGenerator", []):
        data = {}
        for f in gen.get("files", []):
            path = directory / f
            assert path.is_file(), f"{kfile}: generator file {f} does not exist"
            used.add(path.resolve())
            data[path.name] = path.read_text()
        objs.append({"apiVersion": "v1", "kind": "ConfigMap",
                     "metadata": {"name": gen["name"]}, "data": data})  # fmt: skip
    for patch in k.get("patches", []):
        if "path" in patch:
            used.add((directory / patch["path"]).resolve())
        t = patch.get("target") or {}
        matches = [
            o for o in objs
            if o["kind"] == t.get("kind", o["kind"])
            and o["metadata"]["name"] == t.get("name", o["metadata"]["name"])
            and o["apiVersion"].startswith(t.get("group", ""))
        ]  # fmt: skip
        assert matches, f"{kfile}: patch target {t} matches no object"
    if ns := k.get("namespace"):
        for o in objs:
            o["metadata"]["namespace"] = ns
    return objs


def find(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    hits = [o for o in objs if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


@pytest.fixture(scope="module")
def base() -> list[Obj]:
    return resolve(DEPLOY / "base")


def picker(objs: list[Obj]) -> Obj:
    return find(objs, "Deployment", "extproc")["spec"]["template"]["spec"]["containers"][0]


# --- parsing and schemas ----------------------------------------------------------------------


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_parses_into_objects(path: Path) -> None:
    docs = load_docs(path)
    assert docs
    if path.name == "envoy.yaml":  # an Envoy bootstrap, not a Kubernetes object
        assert "static_resources" in docs[0]
        return
    for d in docs:
        assert {"apiVersion", "kind"} <= d.keys(), path
        if d["kind"] != "Kustomization":
            assert d["metadata"]["name"]


def test_every_file_is_used_by_a_kustomization() -> None:
    used: set[Path] = set()
    for o in OVERLAYS:
        resolve(DEPLOY / o, used)
    orphans = {p.resolve() for p in yaml_files()} - {u.resolve() for u in used}
    assert not orphans


def core_objects() -> Iterator[tuple[str, Obj]]:
    for path in yaml_files():
        for d in load_docs(path):
            if d.get("apiVersion") in CORE_GROUPS:
                yield f"{path.relative_to(DEPLOY)}:{d['kind']}/{d['metadata']['name']}", d


@pytest.mark.parametrize(("where", "obj"), list(core_objects()), ids=lambda x: x)
def test_core_kinds_match_the_kubernetes_schema(where: str, obj: Obj) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_core_kinds_were_found() -> None:
    kinds = {o["kind"] for _, o in core_objects()}
    assert {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "ConfigMap",
            "PodDisruptionBudget"} <= kinds  # fmt: skip


# --- CRD usage against the v1 fields (FACTS.md §4, Gateway API v1) ----------------------------

# A schema is a dict of allowed fields (value: sub-schema), a list holding the item schema,
# a set of allowed values, or a type.
_PORT = {"number": int}
INFERENCE_POOL_SPEC = {
    "selector": {"matchLabels": dict},
    "targetPorts": [_PORT],
    "appProtocol": {"http", "kubernetes.io/h2c"},
    "endpointPickerRef": {
        "group": str,
        "kind": {"Service"},
        "name": str,
        "port": _PORT,
        "failureMode": {"FailOpen", "FailClose"},
    },
}
_PARENT_REF = {"group": str, "kind": str, "namespace": str, "name": str, "sectionName": str,
               "port": int}  # fmt: skip
HTTP_ROUTE_SPEC = {
    "parentRefs": [_PARENT_REF],
    "hostnames": [str],
    "rules": [
        {
            "name": str,
            "matches": [{"path": {"type": {"Exact", "PathPrefix", "RegularExpression"},
                                  "value": str},
                         "headers": [dict], "queryParams": [dict], "method": str}],
            "backendRefs": [{"group": str, "kind": str, "name": str, "namespace": str,
                             "port": int, "weight": int, "filters": [dict]}],
            "timeouts": {"request": str, "backendRequest": str},
            "filters": [dict],
        }
    ],
}  # fmt: skip
GATEWAY_SPEC = {
    "gatewayClassName": str,
    "listeners": [
        {
            "name": str,
            "hostname": str,
            "port": int,
            "protocol": {"HTTP", "HTTPS", "TLS", "TCP", "UDP"},
            "tls": dict,
            "allowedRoutes": {"namespaces": {"from": {"All", "Same", "Selector"},
                                             "selector": dict},
                              "kinds": [dict]},
        }
    ],
    "addresses": [dict],
    "infrastructure": dict,
}  # fmt: skip


def check_fields(value: Any, schema: Any, where: str) -> None:
    if isinstance(schema, dict):
        assert isinstance(value, dict), f"{where}: expected a mapping"
        for key, sub in value.items():
            assert key in schema, f"{where}.{key}: not a field of the v1 API"
            check_fields(sub, schema[key], f"{where}.{key}")
    elif isinstance(schema, list):
        assert isinstance(value, list), f"{where}: expected a list"
        for i, item in enumerate(value):
            check_fields(item, schema[0], f"{where}[{i}]")
    elif isinstance(schema, set):
        assert value in schema, f"{where}: {value!r} not one of {sorted(schema)}"
    else:
        assert isinstance(value, schema), f"{where}: expected {schema.__name__}"


def all_objects() -> list[Obj]:
    return [d for p in yaml_files() if p.name != "envoy.yaml" for d in load_docs(p)]


def test_inference_pools_use_only_v1_fields_with_valid_values() -> None:
    pools = [o for o in all_objects() if o["kind"] == "InferencePool"]
    assert pools
    for p in pools:
        assert p["apiVersion"] == "inference.networking.k8s.io/v1"
        spec = p["spec"]
        check_fields(spec, INFERENCE_POOL_SPEC, "spec")
        assert 1 <= len(spec["selector"]["matchLabels"]) <= 64
        assert 1 <= len(spec["targetPorts"]) <= 8
        assert all(1 <= t["number"] <= 65535 for t in spec["targetPorts"])
        ref = spec["endpointPickerRef"]
        assert ref["name"] and 1 <= ref["port"]["number"] <= 65535


def test_gateway_api_objects_use_only_v1_fields() -> None:
    seen = set()
    for o in all_objects():
        if o["apiVersion"] != "gateway.networking.k8s.io/v1":
            continue
        seen.add(o["kind"])
        schema = {"Gateway": GATEWAY_SPEC, "HTTPRoute": HTTP_ROUTE_SPEC}[o["kind"]]
        check_fields(o["spec"], schema, f"{o['kind']}/{o['metadata']['name']}.spec")
    assert seen == {"Gateway", "HTTPRoute"}


@pytest.mark.parametrize("overlay", ["overlays/gateway-api", "overlays/istio"])
def test_http_route_sends_to_the_pool_through_the_gateway(overlay: str) -> None:
    objs = resolve(DEPLOY / overlay)
    route = find(objs, "HTTPRoute")
    (parent,) = route["spec"]["parentRefs"]
    find(objs, "Gateway", parent["name"])
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert backend["group"] == "inference.networking.k8s.io"
    assert backend["kind"] == "InferencePool"
    pool = find(objs, "InferencePool", backend["name"])
    assert backend["port"] in [t["number"] for t in pool["spec"]["targetPorts"]]
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["failureMode"] == "FailClose"
    service = find(objs, "Service", ref["name"])
    assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]


def test_istio_overlay_targets_istio_and_the_picker_service() -> None:
    objs = resolve(DEPLOY / "overlays/istio")
    rule = find(objs, "DestinationRule")
    assert rule["apiVersion"] == "networking.istio.io/v1"
    find(objs, "Service", rule["spec"]["host"])
    assert rule["spec"]["trafficPolicy"]["tls"]["mode"] == "SIMPLE"
    # Self-signed by default: verification would refuse the picker's certificate.
    assert rule["spec"]["trafficPolicy"]["tls"]["insecureSkipVerify"] is True
    # The patch is applied by kustomize; the resolver only checks it has a target.
    if shutil.which("kubectl"):
        rendered = kustomize("overlays/istio")
        assert find(rendered, "Gateway")["spec"]["gatewayClassName"] == "istio"


# --- kustomize itself, when available ---------------------------------------------------------


def kustomize(overlay: str) -> list[Obj]:
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY / overlay)], check=True,
                         capture_output=True, text=True, timeout=30).stdout  # fmt: skip
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_renders_namespaced_valid_objects(overlay: str) -> None:
    objs = kustomize(overlay)
    for o in objs:
        assert o["metadata"].get("namespace"), f"{o['kind']}/{o['metadata']['name']}"
        if o["apiVersion"] in CORE_GROUPS:
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert names >= {(o["kind"], o["metadata"]["name"]) for o in resolve(DEPLOY / overlay)
                     if o["kind"] != "ConfigMap"}  # fmt: skip


# --- the picker agrees with our CLI and defaults ----------------------------------------------


def test_picker_args_parse_with_our_cli(base: list[Obj]) -> None:
    from extproc.cli import build_parser

    c = picker(base)
    assert "command" not in c  # the image's ENTRYPOINT is `extproc`
    args, unknown = build_parser().parse_known_args(c["args"])
    assert args.command == "serve"
    assert args.config == "/etc/extproc/config.yaml"
    pool = find(base, "InferencePool")["metadata"]["name"]
    # The discovery flags are being added to `extproc serve`; until then they parse as unknown.
    expected = {"inference_pool": pool, "namespace": "$(POD_NAMESPACE)"}
    for dest, value in expected.items():
        if hasattr(args, dest):
            assert getattr(args, dest) == value
    assert not [u for u in unknown if u not in ("--inference-pool", pool, "--namespace",
                                               "$(POD_NAMESPACE)")]  # fmt: skip
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_picker_ports_and_probes_match_the_defaults(base: list[Obj]) -> None:
    c = picker(base)
    defaults = ServerSettings()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc-extproc": defaults.port, "grpc-health": defaults.health_port,
                     "http-metrics": 9090}  # fmt: skip
    assert c["readinessProbe"]["grpc"] == {"port": defaults.health_port, "service": "readiness"}
    assert c["livenessProbe"]["grpc"] == {"port": defaults.health_port, "service": "liveness"}
    service = find(base, "Service", "extproc")
    assert {p["port"] for p in service["spec"]["ports"]} == {defaults.port,
                                                            defaults.health_port, 9090}  # fmt: skip
    spec = find(base, "Deployment", "extproc")["spec"]
    assert spec["replicas"] >= 2
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    grace = spec["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > defaults.drain_bound_s  # a response under way outlives the drain's bound
    # A liveness failure means a stuck loop, which cannot drain: its kill must not wait the
    # drain's grace, and the picker's own exit on a stuck loop comes within the probe's window.
    live = c["livenessProbe"]
    assert live["terminationGracePeriodSeconds"] <= 15
    assert defaults.loop_stall_exit_s is not None
    assert defaults.loop_stall_exit_s <= live["periodSeconds"] * live["failureThreshold"]


def test_picker_config_loads_and_builds(base: list[Obj], tmp_path: Path) -> None:
    c = picker(base)
    (mount,) = c["volumeMounts"]
    assert mount["mountPath"] == "/etc/extproc"
    volumes = find(base, "Deployment", "extproc")["spec"]["template"]["spec"]["volumes"]
    cm = find(base, "ConfigMap", next(v for v in volumes if v["name"] == mount["name"])
              ["configMap"]["name"])  # fmt: skip
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"])
    settings = load_settings(path)
    from extproc.config import Settings, build_configured_scheduler

    # The default profile of `extproc serve`: cache affinity and load as predicted TTFT.
    assert settings.scheduling is None
    built = build_configured_scheduler(settings).profiles
    default = build_configured_scheduler(Settings()).profiles
    assert {n: [(s.name, s.weight) for s in p.scorers] for n, p in built.items()} == {
        n: [(s.name, s.weight) for s in p.scorers] for n, p in default.items()
    }
    assert "predicted-ttft-scorer" in [s.name for s in built["default"].scorers]
    # TLS on the ext_proc port (the default), as every overlay's gateway connects.
    assert settings.server.effective_tls is not None
    # The index URL names the Redis Service of the base.
    assert settings.index.backend == "redis"
    host_port = settings.index.redis_url.split("//")[1].split("/")[0]
    host, port = host_port.split(":")
    redis = find(base, "Service", host)
    assert int(port) in [p["port"] for p in redis["spec"]["ports"]]


def test_rbac_is_least_privilege_and_bound_to_the_picker(base: list[Obj]) -> None:
    role = find(base, "Role", "extproc")
    rules = {(g, r, tuple(sorted(x["verbs"])))
             for x in role["rules"] for g in x["apiGroups"] for r in x["resources"]}  # fmt: skip
    watch = ("get", "list", "watch")
    assert rules == {
        ("", "pods", watch),
        ("inference.networking.k8s.io", "inferencepools", watch),
        ("llm-d.ai", "inferenceobjectives", watch),  # flow control's priorities
    }
    assert not [o for o in base if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    binding = find(base, "RoleBinding", "extproc")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    sa = find(base, "Deployment", "extproc")["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
    find(base, "ServiceAccount", sa)


def test_pods_run_as_non_root(base: list[Obj]) -> None:
    for d in (o for o in base if o["kind"] == "Deployment"):
        pod = d["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]


# --- data paths mirror `extproc envoy-config` -------------------------------------------------


def test_envoy_overlay_bootstrap_is_what_envoy_config_prints() -> None:
    objs = resolve(DEPLOY / "overlays/envoy")
    bootstrap = find(objs, "ConfigMap", "envoy-bootstrap")["data"]["envoy.yaml"]
    assert bootstrap == render_bootstrap(BootstrapOptions(extproc="extproc-headless:9002"))
    picker_cluster = next(
        c
        for c in yaml.safe_load(bootstrap)["static_resources"]["clusters"]
        if c["name"] == "extproc"
    )
    assert picker_cluster["transport_socket"]["name"] == "envoy.transport_sockets.tls"
    headless = find(objs, "Service", "extproc-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["ports"][0]["port"] == ServerSettings().port
    envoy = find(objs, "Deployment", "envoy")["spec"]["template"]["spec"]["containers"][0]
    listen = yaml.safe_load(bootstrap)["static_resources"]["listeners"][0]
    assert envoy["ports"][0]["containerPort"] == listen["address"]["socket_address"]["port_value"]


def test_envoyfilter_mirrors_the_bootstrap_filters_and_cluster() -> None:
    objs = resolve(DEPLOY / "overlays/istio/envoyfilter")
    ef = find(objs, "EnvoyFilter")
    assert ef["apiVersion"] == "networking.istio.io/v1alpha3"
    patches = ef["spec"]["configPatches"]
    filters = [p["patch"]["value"] for p in patches if p["applyTo"] == "HTTP_FILTER"]
    boot = build_bootstrap(BootstrapOptions())["static_resources"]
    hcm = boot["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    want = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.router"]
    grpc = filters[1]["typed_config"]["grpc_service"]["envoy_grpc"]
    assert grpc["cluster_name"] == f"outbound|9002||extproc.{NAMESPACE}.svc.cluster.local"
    grpc["cluster_name"] = "extproc"
    # Inserted disabled: only the inference route enables it (below).
    assert filters[1].pop("disabled") is True
    assert filters == want
    (cluster,) = [p["patch"]["value"] for p in patches if p["applyTo"] == "CLUSTER"]
    model = next(c for c in boot["clusters"] if c["name"] == "model_servers")
    assert {**cluster, "name": "model_servers"} == model
    (route,) = [p for p in patches if p["applyTo"] == "HTTP_ROUTE"]
    assert route["patch"]["value"]["route"]["cluster"] == cluster["name"]
    enable = route["patch"]["value"]["typed_per_filter_config"]["envoy.filters.http.ext_proc"]
    assert enable == {
        "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig",
        "config": {},
    }
    # The overlay reaches the picker over TLS, as the picker serves by default.
    rule = find(objs, "DestinationRule")
    assert rule["spec"]["trafficPolicy"]["tls"]["mode"] == "SIMPLE"
    vs = find(objs, "VirtualService")
    assert route["match"]["routeConfiguration"]["vhost"]["route"]["name"] in [
        h["name"] for h in vs["spec"]["http"]
    ]


def test_network_policy_admits_only_gateway_pods_to_ext_proc(base: list[Obj]) -> None:
    """docs/security.md: the ext_proc port only from labelled gateway pods (the Envoy overlay
    labels its pods), metrics only from a monitoring namespace, health from anywhere."""
    policy = find(base, "NetworkPolicy", "extproc")
    picker = find(base, "Deployment", "extproc")
    assert policy["spec"]["podSelector"]["matchLabels"] == picker["spec"]["selector"]["matchLabels"]
    rules = {r["ports"][0]["port"]: r.get("from") for r in policy["spec"]["ingress"]}
    named = {p["name"] for c in picker["spec"]["template"]["spec"]["containers"]
             for p in c["ports"]}  # fmt: skip
    assert set(rules) == named
    (client,) = rules["grpc-extproc"]
    label = client["podSelector"]["matchLabels"]
    assert label == {"extproc.io/client": "true"}
    assert rules["grpc-health"] is None
    assert rules["http-metrics"][0]["namespaceSelector"]["matchLabels"]
    envoy = find(resolve(DEPLOY / "overlays/envoy"), "Deployment", "envoy")
    assert label.items() <= envoy["spec"]["template"]["metadata"]["labels"].items()


# --- Prometheus Operator: the picker's /metrics is scraped --------------------------------------

# ServiceMonitor (monitoring.coreos.com/v1) fields this repository uses, a subset of the CRD.
SERVICE_MONITOR_SPEC = {
    "selector": {"matchLabels": dict},
    "namespaceSelector": {"matchNames": [str], "any": bool},
    "jobLabel": str,
    "endpoints": [{"port": str, "path": str, "scheme": {"http", "https"}, "interval": str,
                   "scrapeTimeout": str, "honorLabels": bool}],
}  # fmt: skip


def _seconds(duration: str) -> float:
    assert duration[-1] in "sm" and duration[:-1].isdigit(), duration
    return int(duration[:-1]) * (60 if duration[-1] == "m" else 1)


def test_service_monitor_scrapes_the_pickers_metrics_port() -> None:
    objs = resolve(DEPLOY / "overlays/monitoring")
    sm = find(objs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    check_fields(sm["spec"], SERVICE_MONITOR_SPEC, "ServiceMonitor.spec")
    wanted = sm["spec"]["selector"]["matchLabels"]
    services = [o for o in objs if o["kind"] == "Service"
                and wanted.items() <= o["metadata"].get("labels", {}).items()]  # fmt: skip
    assert [s["metadata"]["name"] for s in services] == ["extproc"]
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert _seconds(endpoint["scrapeTimeout"]) <= _seconds(endpoint["interval"])
    # The named Service port leads to the container port the picker serves /metrics on.
    port = next(p for p in services[0]["spec"]["ports"] if p["name"] == endpoint["port"])
    container = {p["name"]: p["containerPort"] for p in picker(objs)["ports"]}
    assert container[port["targetPort"]] == ServerSettings().admin_port
