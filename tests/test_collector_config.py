"""The collector configurations in collector/ (and their copies in deploy/k8s/).

First the collector itself: pdproxy's distribution (collector/builder-config.yaml, built by
collector/build.sh) runs `validate` on each file, which decodes every component's configuration
into its config struct (unknown keys, wrong types and bad durations fail), checks the pipelines and
compiles the OTTL statements. Then what validate cannot know: the current component names (old ones
still load, with a warning), the intended topology (no sampling before the derived metrics, the
tier-1/tier-2 split), and the contract with the proxy (span attributes of docs/reference/telemetry.md,
buckets of pdproxy/telemetry/names.py).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from test_grafana_dashboards import contract_span_attributes

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {name: REPO / "collector" / name for name in ("otelcol.yaml", "otelcol-tier1.yaml", "otelcol-tier2.yaml")}
K8S_COPIES = [REPO / "deploy" / "k8s" / "base" / "collector" / name for name in ("otelcol-tier1.yaml", "otelcol-tier2.yaml")]


def load(name: str) -> dict:
    return yaml.safe_load(CONFIGS[name].read_text())


# Old names still load in 2026 but log deprecation warnings (research/observability.md §2.1).
DEPRECATED = {
    ("exporters", "otlp"): "otlp_grpc", ("exporters", "otlphttp"): "otlp_http",
    ("exporters", "loadbalancing"): "load_balancing",
    ("exporters", "prometheusremotewrite"): "prometheus_remote_write", ("connectors", "spanmetrics"): "span_metrics",
    ("connectors", "signaltometrics"): "signal_to_metrics", ("processors", "deltatocumulative"): "delta_to_cumulative",
    ("processors", "batch"): "exporter sending_queue.batch",
}

# (pipeline signal it consumes as an exporter, signal it emits as a receiver)
CONNECTOR_SIGNALS = {"span_metrics": ({"traces"}, "metrics"), "signal_to_metrics": ({"traces", "logs", "metrics"}, "metrics")}
DEPRECATED_KEYS = {"dimensions_cache_size", "resource_to_telemetry_conversion", "add_metric_suffixes"}


# ---------------------------------------------------------------------------------------------
# The collector's own word (pdproxy's distribution, collector/build.sh)


@pytest.mark.parametrize("path", [*CONFIGS.values(), *K8S_COPIES], ids=lambda p: str(p.relative_to(REPO)))
def test_the_collector_validates_it(path):
    from gotools import validate

    r = validate(path)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_collector_runs_it_without_deprecation_warnings(name):
    """`validate` builds no pipeline, so the warnings of deprecated aliases (and OTTL paths without
    their context prefix) only show at start."""
    from gotools import load_config, running_collector

    with running_collector(load_config(name)) as collector:
        pass
    warnings = [line for line in collector.output().splitlines()
                if "deprecated" in line.lower() or "rewrite them accordingly" in line]
    assert not warnings, "\n".join(warnings)


def test_the_distribution_has_exactly_the_components_used():
    """collector/builder-config.yaml: what the three configurations use, plus the debug, file and
    OTLP/HTTP exporters for local diagnosis; nothing else."""
    from gotools import collector_binary

    r = subprocess.run([str(collector_binary()), "components"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    listed = yaml.safe_load(r.stdout)
    built = {(section, c["name"]) for section in ("receivers", "processors", "exporters", "connectors", "extensions")
             for c in listed.get(section) or []}
    used = {(section, kind(cid)) for name in CONFIGS for section in ("receivers", "processors", "exporters",
                                                                     "connectors", "extensions")
            for cid in load(name).get(section) or {}}
    assert built == used | {("exporters", "debug"), ("exporters", "file"), ("exporters", "otlp_http")}
    # one release for every module: v0.N.x, and v1.M.x for the modules already declared stable
    releases = {c["module"].split()[-1] for section in listed.values() if isinstance(section, list) for c in section}
    assert len(releases) == 2 and sorted(r[:3] for r in releases) == ["v0.", "v1."], releases
    assert listed["buildinfo"]["version"].startswith(min(releases)[1:])


def test_deploy_files_pin_the_release_of_the_distribution():
    manifest = (REPO / "collector" / "builder-config.yaml").read_text()
    (release,) = set(re.findall(r"opentelemetry-collector-contrib/\S+ v(\d+\.\d+\.\d+)", manifest))
    assert set(re.findall(r"go\.opentelemetry\.io/collector/\S+ v0\.(\d+)\.", manifest)) == {release.split(".")[1]}
    pins = []
    for path in [REPO / "deploy" / "compose.yaml", *sorted((REPO / "deploy" / "k8s").rglob("*.yaml"))]:
        pins += re.findall(r"opentelemetry-collector-contrib:(\S+)", path.read_text())
    kustomization = yaml.safe_load((REPO / "deploy" / "k8s" / "base" / "kustomization.yaml").read_text())
    pins += [i["newTag"] for i in kustomization["images"] if i["name"] == "otel/opentelemetry-collector-contrib"]
    assert len(pins) >= 4 and set(pins) == {release}, pins


# ---------------------------------------------------------------------------------------------
# What validate cannot know


def kind(component_id: str) -> str:
    return component_id.split("/")[0]


def signal(pipeline_id: str) -> str:
    return pipeline_id.split("/")[0]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_current_component_names_and_keys(name):
    cfg = load(name)
    assert set(cfg) <= {"extensions", "receivers", "processors", "connectors", "exporters", "service"}
    for section in ("extensions", "receivers", "processors", "connectors", "exporters"):
        for cid, body in (cfg.get(section) or {}).items():
            assert (section, kind(cid)) not in DEPRECATED, f"{cid}: use {DEPRECATED[(section, kind(cid))]}"
            assert not set(body or {}) & DEPRECATED_KEYS, f"{cid}: deprecated keys {set(body) & DEPRECATED_KEYS}"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_pipeline_wiring(name):
    cfg = load(name)
    service = cfg["service"]
    defined = {s: set(cfg.get(s) or {}) for s in ("receivers", "processors", "exporters", "connectors", "extensions")}
    assert set(service["extensions"]) == defined["extensions"]
    used = {"receivers": set(), "processors": set(), "exporters": set(), "connectors": set()}
    for pid, p in service["pipelines"].items():
        assert signal(pid) in {"traces", "metrics", "logs"}
        assert p["processors"][0] == "memory_limiter", f"{pid}: memory_limiter must come first"
        assert len(p["processors"]) == len(set(p["processors"]))
        for r in p["receivers"]:
            if r in defined["connectors"]:
                assert CONNECTOR_SIGNALS[kind(r)][1] == signal(pid), f"{pid}: {r} emits {CONNECTOR_SIGNALS[kind(r)][1]}"
                used["connectors"].add(r)
            else:
                assert r in defined["receivers"], f"{pid}: undefined receiver {r}"
                used["receivers"].add(r)
        for e in p["exporters"]:
            if e in defined["connectors"]:
                assert signal(pid) in CONNECTOR_SIGNALS[kind(e)][0], f"{pid}: {e} does not consume {signal(pid)}"
                used["connectors"].add(e)
            else:
                assert e in defined["exporters"], f"{pid}: undefined exporter {e}"
                used["exporters"].add(e)
        for proc in p["processors"]:
            assert proc in defined["processors"], f"{pid}: undefined processor {proc}"
            used["processors"].add(proc)
    for section, names in used.items():
        assert names == defined[section], f"defined but unused {section}: {defined[section] - names}"
    # every connector is both an exporter and a receiver somewhere
    for c in defined["connectors"]:
        assert any(c in p["exporters"] for p in service["pipelines"].values())
        assert any(c in p["receivers"] for p in service["pipelines"].values())


def default(value: str) -> str:
    """A setting as the collector reads it with nothing in the environment: `${env:VAR:-default}` is its default."""
    m = re.fullmatch(r"\$\{env:[A-Z_][A-Z0-9_]*:-(.*)\}", str(value))
    return m.group(1) if m else value


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_listeners_bind_all_interfaces_in_containers(name):
    # Since v0.104 the default host is localhost, unreachable from other containers or pods.
    cfg = load(name)
    assert default(cfg["extensions"]["health_check"]["endpoint"]) == "0.0.0.0:13133"
    for proto, body in cfg["receivers"]["otlp"]["protocols"].items():
        assert default(body["endpoint"]) == {"grpc": "0.0.0.0:4317", "http": "0.0.0.0:4318"}[proto]
    if "prometheus" in (cfg.get("exporters") or {}):
        assert default(cfg["exporters"]["prometheus"]["endpoint"]) == "0.0.0.0:8889"


def test_the_single_collectors_listeners_come_from_the_environment():
    """Moved without editing the file (two collectors, or a collector and Jaeger, on one host)."""
    cfg = load("otelcol.yaml")
    settings = [cfg["extensions"]["health_check"]["endpoint"], cfg["exporters"]["prometheus"]["endpoint"],
                *(body["endpoint"] for body in cfg["receivers"]["otlp"]["protocols"].values()),
                *cfg["service"]["telemetry"]["metrics"]["readers"][0]["pull"]["exporter"]["prometheus"].values(),
                cfg["exporters"]["otlp_grpc/tempo"]["endpoint"], cfg["processors"]["tail_sampling"]["decision_wait"]]
    for value in settings:
        assert default(value) != value, f"{value} is not an ${{env:...}} reference with a default"


def test_single_instance_topology():
    """Metrics from every span (before sampling); a tail-sampled copy to Tempo."""
    cfg = load("otelcol.yaml")
    pipes = cfg["service"]["pipelines"]
    feeding = [p for p in pipes.values() if "span_metrics" in p["exporters"]]
    assert len(feeding) == 1 and set(feeding[0]["exporters"]) == {"span_metrics", "signal_to_metrics"}
    assert feeding[0]["processors"] == ["memory_limiter"], "no sampling or filtering before the derived metrics"
    sampled = [p for p in pipes.values() if "tail_sampling" in p["processors"]]
    assert len(sampled) == 1 and sampled[0]["exporters"] == ["otlp_grpc/tempo"]
    assert sampled[0]["receivers"] == feeding[0]["receivers"] == ["otlp"]
    (metrics,) = [p for p in pipes.values() if "prometheus" in p["exporters"]]
    assert set(metrics["receivers"]) == {"span_metrics", "signal_to_metrics"}
    assert "delta_to_cumulative" in metrics["processors"]
    prom = cfg["exporters"]["prometheus"]
    assert prom["enable_open_metrics"] is True  # exemplars
    assert cfg["connectors"]["span_metrics"]["exemplars"]["enabled"] is True


def test_two_tier_topology():
    tier1, tier2, single = load("otelcol-tier1.yaml"), load("otelcol-tier2.yaml"), load("otelcol.yaml")
    # tier 1: derived metrics from the unsampled stream, spans routed by trace id, no sampling
    assert tier1["connectors"] == single["connectors"]
    assert "tail_sampling" not in tier1["processors"]
    lb = tier1["exporters"]["load_balancing"]
    assert lb["routing_key"] == "traceID"
    assert set(lb["resolver"]) <= {"dns", "k8s", "static", "aws_cloud_map"} and len(lb["resolver"]) == 1
    assert set(lb["protocol"]) == {"otlp"} and lb["protocol"]["otlp"]["tls"]["insecure"] is True
    forward = [p for p in tier1["service"]["pipelines"].values() if "load_balancing" in p["exporters"]]
    assert forward and forward[0]["processors"] == ["memory_limiter"]
    metrics_pipes = {pid: p for pid, p in tier1["service"]["pipelines"].items() if "prometheus" in p["exporters"]}
    assert metrics_pipes == {pid: p for pid, p in single["service"]["pipelines"].items() if "prometheus" in p["exporters"]}
    # tier 2: the same policies as the single instance, nothing derived
    assert "connectors" not in tier2
    assert tier2["processors"]["tail_sampling"] == single["processors"]["tail_sampling"]
    assert tier2["exporters"]["otlp_grpc/tempo"] == single["exporters"]["otlp_grpc/tempo"]


def test_tail_sampling_policies():
    ts = load("otelcol.yaml")["processors"]["tail_sampling"]
    by_type = {}
    for policy in ts["policies"]:
        assert set(policy) <= {"name", "type", policy["type"]}
        by_type.setdefault(policy["type"], []).append(policy)
    assert by_type["status_code"][0]["status_code"]["status_codes"] == ["ERROR"]
    ottl = " ".join(c for p in by_type["ottl_condition"] for c in p["ottl_condition"]["span"])
    assert 'attributes["gen_ai.response.time_to_first_chunk"] >' in ottl  # slow TTFT
    stalls = by_type["numeric_attribute"][0]["numeric_attribute"]
    assert stalls["key"] == "pd.stalls" and stalls["min_value"] == 1  # integer attribute: numeric policy fits
    assert 0 < by_type["probabilistic"][0]["probabilistic"]["sampling_percentage"] <= 20  # baseline share
    # the root span (TTFT, stalls) is exported last: the decision must wait for it
    assert int(re.fullmatch(r"(\d+)s", default(ts["decision_wait"])).group(1)) >= 30


def _ottl_strings(cfg: dict) -> list[str]:
    out = []
    for m in cfg["connectors"]["signal_to_metrics"]["spans"]:
        out += m.get("conditions", [])
        for t in ("histogram", "sum"):
            if t in m:
                out.append(m[t]["value"])
    for p in cfg["processors"]["tail_sampling"]["policies"]:
        if p["type"] == "ottl_condition":
            out += p["ottl_condition"]["span"]
    return out


def test_ottl_expressions_name_contract_attributes():
    cfg = load("otelcol.yaml")
    known = contract_span_attributes()
    strings = _ottl_strings(cfg)
    assert len(strings) >= 10
    for s in strings:
        assert s.count('"') % 2 == 0 and s.count("[") == s.count("]") and s.count("(") == s.count(")"), s
        assert not re.search(r"\b(AND|OR|NOT)\b", s), f"OTTL operators are lower case: {s}"
        for attr in re.findall(r'attributes\["([^"]+)"\]', s):
            assert attr in known, f"{attr} (in {s}) is not in docs/reference/telemetry.md"
    for m in cfg["connectors"]["signal_to_metrics"]["spans"]:
        # without this list every resource attribute becomes part of the series identity
        assert m["include_resource_attributes"], m["name"]
        for a in m.get("attributes", []):
            assert a["key"] in known, a
            assert "default_value" in a or a.get("optional"), f"{m['name']}: {a['key']} absent would drop the data point"
        value = (m.get("histogram") or m.get("sum"))["value"]
        read = re.findall(r'span\.attributes\["([^"]+)"\]', value)
        if read:  # the condition guards exactly the attribute the value reads
            assert any(f'span.attributes["{read[0]}"] != nil' in c for c in m["conditions"]), m["name"]


def test_buckets_equal_the_proxys():
    import sys

    sys.path.insert(0, str(REPO))
    from pdproxy.telemetry.names import GAP_BUCKETS, LATENCY_BUCKETS

    cfg = load("otelcol.yaml")
    for m in cfg["connectors"]["signal_to_metrics"]["spans"]:
        if "histogram" in m:
            expected = GAP_BUCKETS if ".itl." in m["name"] else LATENCY_BUCKETS
            assert tuple(m["histogram"]["buckets"]) == expected, m["name"]

    def seconds(duration: str) -> float:
        number, unit = re.fullmatch(r"([\d.]+)(ms|s)", duration).groups()
        return float(number) / (1000 if unit == "ms" else 1)

    spans = cfg["connectors"]["span_metrics"]["histogram"]
    assert spans["unit"] == "s"
    assert tuple(seconds(b) for b in spans["explicit"]["buckets"]) == pytest.approx(LATENCY_BUCKETS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_environment_references(name):
    text = CONFIGS[name].read_text()
    for ref in re.findall(r"\$\{[^}]*\}", text):
        assert re.fullmatch(r"\$\{env:[A-Z_][A-Z0-9_]*(:-[^}]+)?\}", ref), f"malformed reference {ref}"
    assert not re.search(r"\$[A-Za-z_]", text.replace("${", "")), "bare $VAR references are not expanded"
