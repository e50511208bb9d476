"""Recording rules, alerts and their runbooks (deploy/prometheus/rules/, docs/reference/runbooks.md).

What runs: `promtool check rules` on the rule files, `promtool test rules` on the unit tests in
tests/promtool/ (synthetic series, every alert firing in one case and quiet in another), checks that
those series carry the real metric names, labels and bucket bounds (the proxy's contract in
docs/reference/telemetry.md, the collector's configuration), that every alert has its two cases and a
runbook entry naming real dashboard panels, and that the Prometheus Operator's PrometheusRule and
the compose stack load exactly these files. The same rules loaded into a live Prometheus under a
real load: tests/test_prometheus_live.py.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from test_deploy import DURATION, K8S, by_kind, kustomize
from test_grafana_dashboards import collector_prometheus_names, contract_metrics, load_dashboards, metric_names, panels, series_base

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "deploy" / "prometheus" / "rules"
UNIT_TESTS = Path(__file__).resolve().parent / "promtool"
RUNBOOKS = REPO / "docs" / "reference" / "runbooks.md"
sys.path.insert(0, str(REPO))


def rule_files() -> list[Path]:
    return sorted(RULES.glob("*.yml"))


def rule_groups() -> list[dict]:
    return [g for path in rule_files() for g in yaml.safe_load(path.read_text())["groups"]]


def rules(kind: str) -> dict[str, dict]:
    return {r[kind]: r for g in rule_groups() for r in g["rules"] if kind in r}


def unit_test_files() -> list[Path]:
    return sorted(UNIT_TESTS.glob("*.test.yml"))


def promtool() -> str:
    return shutil.which("promtool") or pytest.skip("promtool not installed (Debian package prometheus; .ci/run installs it)")


# ---------------------------------------------------------------------------------------------
# promtool


@pytest.mark.parametrize("path", rule_files(), ids=lambda p: p.name)
def test_rule_files_pass_promtool_check(path):
    n = len([r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]])
    r = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0 and f"SUCCESS: {n} rules found" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("path", unit_test_files(), ids=lambda p: p.name)
def test_promtool_unit_tests_pass(path):
    r = subprocess.run([promtool(), "test", "rules", str(path)], capture_output=True, text=True, cwd=UNIT_TESTS)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_unit_tests_load_every_rule_file_in_a_fixed_group_order():
    """Every test file loads all the rule files, and evaluates every group, recording ones first
    (without group_eval_order promtool's order is random and the alerts read stale recordings)."""
    expected = {p.resolve() for p in rule_files()}
    names = [g["name"] for g in rule_groups()]
    recording = [g["name"] for g in rule_groups() if any("record" in r for r in g["rules"])]
    for path in unit_test_files():
        doc = yaml.safe_load(path.read_text())
        assert {(path.parent / f).resolve() for f in doc["rule_files"]} == expected, path.name
        order = doc["group_eval_order"]
        assert sorted(order) == sorted(names), path.name
        assert order[:len(recording)] == recording, path.name


def test_promtool_tests_catch_a_moved_threshold(tmp_path):
    """The unit tests have teeth: the stall cases fail once the stall bound moves from 5% to 50%."""
    for path in rule_files():
        text = path.read_text()
        if path.name == "pdproxy-alerts.yml":
            assert "pdproxy_requests_with_stall:ratio_rate5m{deployment=\"primary\"} > 0.05" in text
            text = text.replace("pdproxy_requests_with_stall:ratio_rate5m{deployment=\"primary\"} > 0.05",
                                "pdproxy_requests_with_stall:ratio_rate5m{deployment=\"primary\"} > 0.5")
        (tmp_path / path.name).write_text(text)
    doc = yaml.safe_load((UNIT_TESTS / "alerts.test.yml").read_text())
    doc["rule_files"] = [p.name for p in rule_files()]
    doc["tests"] = [t for t in doc["tests"] if any(c["alertname"] == "PdproxyTailITLStalls" for c in t.get("alert_rule_test", []))]
    assert len(doc["tests"]) == 2
    (tmp_path / "stalls.test.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    r = subprocess.run([promtool(), "test", "rules", "stalls.test.yml"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode != 0 and "alertname: PdproxyTailITLStalls" in r.stdout + r.stderr, r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------
# Every alert: a case where it fires, a case where it does not, a runbook entry


def cases(docs: list[dict]) -> dict[str, dict[str, int]]:
    """{alertname: {"fires": n, "quiet": n}} over the alert_rule_test cases of promtool test files."""
    out: dict[str, dict[str, int]] = {}
    for doc in docs:
        for test in doc["tests"]:
            for case in test.get("alert_rule_test", []):
                counts = out.setdefault(case["alertname"], {"fires": 0, "quiet": 0})
                counts["fires" if case.get("exp_alerts") else "quiet"] += 1
    return out


def missing_cases(alert_names: set[str], docs: list[dict]) -> list[str]:
    found = cases(docs)
    problems = [f"{a}: no case where it fires" for a in sorted(alert_names) if not found.get(a, {}).get("fires")]
    problems += [f"{a}: no case where it does not fire" for a in sorted(alert_names) if not found.get(a, {}).get("quiet")]
    problems += [f"{a}: tested but not an alert" for a in sorted(set(found) - alert_names)]
    return problems


def test_every_alert_has_a_firing_and_a_quiet_case():
    docs = [yaml.safe_load(p.read_text()) for p in unit_test_files()]
    alert_names = set(rules("alert"))
    assert len(alert_names) >= 12
    assert missing_cases(alert_names, docs) == []
    # and the check notices a missing case
    trimmed = copy.deepcopy(docs)
    for doc in trimmed:
        for test in doc["tests"]:
            test["alert_rule_test"] = [c for c in test.get("alert_rule_test", [])
                                       if not (c["alertname"] == "PdproxySpansDropped" and not c.get("exp_alerts"))]
    assert missing_cases(alert_names, trimmed) == ["PdproxySpansDropped: no case where it does not fire"]
    assert missing_cases(alert_names | {"PdproxyNew"}, docs) == ["PdproxyNew: no case where it fires",
                                                                  "PdproxyNew: no case where it does not fire"]


def runbook_sections() -> dict[str, str]:
    text = RUNBOOKS.read_text()
    parts = re.split(r"^### (\w+)\n", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def dashboard_titles() -> dict[str, set[str]]:
    return {d["title"]: {p["title"] for p in panels(d)} for d in load_dashboards().values()}


def test_every_alert_has_a_runbook_entry():
    sections = runbook_sections()
    alerts = rules("alert")
    assert set(sections) == set(alerts), "one runbook entry per alert, no more"
    titles = dashboard_titles()
    for name, rule in alerts.items():
        ann = rule["annotations"]
        assert ann["summary"] and ann["description"], name
        assert ann["runbook_url"] == f"docs/reference/runbooks.md#{name.lower()}", name  # GitHub's anchor of "### Name"
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        body = sections[name]
        for part in ("**Meaning.**", "**Dashboard.**", "**Drill-down.**", "**Usual causes.**"):
            assert part in body, f"{name}: runbook entry has no {part}"
        dash = body[body.index("**Dashboard.**"):body.index("**Drill-down.**")]
        named = re.findall(r"\*(pdproxy — [^*]+)\* › ((?:“[^”]+”(?:,| and|\s)*)+)", dash)
        assert named, f"{name}: the Dashboard part names no dashboard › panel"
        for dashboard, refs in named:
            dashboard = " ".join(dashboard.split())
            assert dashboard in titles, f"{name}: no dashboard {dashboard!r}"
            for panel in re.findall(r"“([^”]+)”", refs):
                assert " ".join(panel.split()) in titles[dashboard], f"{name}: no panel {panel!r} in {dashboard}"


def test_runbook_table_matches_the_rules():
    rows = re.findall(r"^\| `(\w+)` \| (\w+) \| [^|]+ \| [^|]+ \| (\S+) \|$", RUNBOOKS.read_text(), flags=re.M)
    table = {name: (severity, for_) for name, severity, for_ in rows}
    alerts = rules("alert")
    assert table == {name: (r["labels"]["severity"], r.get("for", "–")) for name, r in alerts.items()}


# ---------------------------------------------------------------------------------------------
# Real names: the rules read, and the unit tests feed, the series the proxy and collector expose

SERIES = re.compile(r"^([a-zA-Z_:][\w:]*)\{(.*)\}$")
LABEL = re.compile(r'(\w+)="([^"]*)"')
SCRAPE_LABELS = {"job", "instance"}  # added by Prometheus to every scraped series


def error_types() -> set[str]:
    row = next(l for l in (REPO / "docs" / "reference" / "telemetry.md").read_text().splitlines() if l.startswith("| `error.type`"))
    return set(re.findall(r"`([a-z0-9_]+)`", row.split("|")[3]))


def test_rule_expressions_read_real_series():
    _, proxy = contract_metrics()
    collector, _ = collector_prometheus_names()
    recorded = set(rules("record"))
    read = set()
    for rule in [*rules("record").values(), *rules("alert").values()]:
        for m in metric_names(rule["expr"]):
            read.add(m)
            assert m in recorded or m in proxy or series_base(m) in proxy or m in collector, f"{m} in {rule['expr']}"
    # both sources are used
    assert {"pdproxy_ttft_seconds_bucket", "pdproxy_instance_healthy", "pdproxy_spans_dropped_total"} <= read
    assert {"pdproxy_trace_requests_total", "pdproxy_trace_kv_transfer_estimated_seconds_bucket"} <= read


def test_unit_test_series_are_real():
    """Metric names, label names and values, bucket bounds: as the proxy and the collector expose them."""
    from pdproxy.telemetry.names import GAP_BUCKETS, LATENCY_BUCKETS

    base, proxy = contract_metrics()
    collector, collector_labels = collector_prometheus_names()
    gap_histograms = {"pdproxy_itl_seconds", "pdproxy_chunk_gap_seconds", "pdproxy_request_itl_max_seconds", "pdproxy_request_itl_p99_seconds",
                      "pdproxy_tpot_seconds", "pdproxy_trace_request_itl_max_seconds", "pdproxy_trace_request_itl_p99_seconds"}
    values = {"deployment": {"primary", "shadow"}, "mode": {"pd", "single"}, "route": {"completions", "chat_completions"},
              "stage": {"queue", "prefill", "kv_transfer", "decode"}, "failed_stage": {"none", "queue", "prefill", "kv_transfer", "decode"},
              "role": {"prefill", "decode"},
              "reason": {"queue_full", "export_failed", "prefix_match", "cache_miss", "imbalanced", "approximate",
                         "rotation"}, "error_type": error_types(),
              "cause": {"kv_arrival", "prefill", "migration", "preemption", "none"},
              "pd_deployment": {"primary", "shadow"}, "pd_failed_stage": {"none", "queue", "prefill", "kv_transfer", "decode"}}
    seen_proxy = seen_collector = 0
    for path in unit_test_files():
        for test in yaml.safe_load(path.read_text())["tests"]:
            for s in test["input_series"]:
                name, body = SERIES.match(s["series"]).groups()
                labels = dict(LABEL.findall(body))
                assert labels.keys() >= SCRAPE_LABELS, s["series"]
                if labels["job"] == "otelcol":
                    seen_collector += 1
                    assert name in collector, f"{path.name}: {name} is not produced by collector/otelcol.yaml"
                    assert set(labels) <= collector_labels, f"{path.name}: {set(labels) - collector_labels} on {name}"
                else:
                    seen_proxy += 1
                    metric = name if name in proxy else series_base(name)
                    assert metric in proxy, f"{path.name}: {name} is not in docs/reference/telemetry.md"
                    allowed = SCRAPE_LABELS | proxy[metric][1] | ({"le"} if name.endswith("_bucket") else set())
                    if metric in {"pdproxy_requests_total", "pdproxy_request_errors_total", "pdproxy_requests_with_stall_total"} \
                            or proxy[metric][0] == "histogram":
                        allowed |= set(base)
                    assert set(labels) <= allowed, f"{path.name}: {set(labels) - allowed} on {name}"
                for label, value in labels.items():
                    assert label not in values or value in values[label], f"{path.name}: {label}={value!r}"
                if "le" in labels and labels["le"] != "+Inf":
                    bounds = GAP_BUCKETS if series_base(name) in gap_histograms else LATENCY_BUCKETS
                    assert float(labels["le"]) in bounds and labels["le"] == repr(float(labels["le"])), s["series"]
    assert seen_proxy >= 50 and seen_collector >= 2


def test_ttft_slo_threshold_is_a_bucket_bound():
    from pdproxy.telemetry.names import LATENCY_BUCKETS

    slo = [r for r in rules("record").values() if "pdproxy_ttft_slo_miss" in r["record"]]
    assert len(slo) == 7
    for r in slo:
        (le,) = re.findall(r'le="([^"]+)"', r["expr"])
        assert le == r["labels"]["slo_ttft_seconds"] and float(le) in LATENCY_BUCKETS, r["record"]


# ---------------------------------------------------------------------------------------------
# Loaded by the compose stack and by the Prometheus Operator


def test_compose_prometheus_loads_the_rule_files():
    cfg_path = REPO / "deploy" / "prometheus" / "prometheus.yml"
    cfg = yaml.safe_load(cfg_path.read_text())
    found = {p.resolve() for pattern in cfg["rule_files"] for p in cfg_path.parent.glob(pattern)}
    assert found == {p.resolve() for p in rule_files()}
    prom = yaml.safe_load((REPO / "deploy" / "compose.yaml").read_text())["services"]["prometheus"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in prom["volumes"] if v.startswith("./"))
    config_dir = str(Path(mounts["./prometheus/prometheus.yml"]).parent)
    for pattern in cfg["rule_files"]:
        folder = str(Path(pattern).parent)
        assert mounts[f"./prometheus/{folder}"] == f"{config_dir}/{folder}", "the rules folder is mounted beside the config"


def test_prometheusrule_is_generated_from_the_rule_files():
    r = subprocess.run([sys.executable, str(REPO / "deploy" / "prometheus" / "prometheusrule.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# Written from the PrometheusRule CRD (monitoring.coreos.com/v1) for the fields used here; unknown
# fields are rejected, as `kubectl apply --validate=strict` would.
PROMETHEUSRULE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "additionalProperties": False, "properties": {"groups": {
            "type": "array", "items": {
                "type": "object", "required": ["name", "rules"], "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "interval": {"type": "string", "pattern": DURATION},
                    "limit": {"type": "integer"},
                    "partial_response_strategy": {"type": "string"},
                    "rules": {"type": "array", "items": {
                        "type": "object", "required": ["expr"], "additionalProperties": False,
                        "oneOf": [{"required": ["record"]}, {"required": ["alert"]}],
                        "properties": {
                            "record": {"type": "string"}, "alert": {"type": "string"},
                            "expr": {"type": ["string", "integer"]},
                            "for": {"type": "string", "pattern": DURATION},
                            "keep_firing_for": {"type": "string", "pattern": DURATION},
                            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                            "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}}}}}}}},
    },
}


def test_operator_overlay_carries_the_rules(tmp_path):
    import jsonschema

    built = by_kind(kustomize(K8S / "overlays" / "prometheus-operator"), "PrometheusRule")
    assert set(built) == {"pdproxy"}
    rule = built["pdproxy"]
    jsonschema.validate(rule, PROMETHEUSRULE_SCHEMA)
    assert rule["metadata"]["namespace"] == "pdproxy"
    assert sorted(rule["spec"]["groups"], key=lambda g: g["name"]) == sorted(rule_groups(), key=lambda g: g["name"])
    # what the operator hands Prometheus passes promtool
    path = tmp_path / "from-kustomize.yml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    r = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0 and f"SUCCESS: {len(rules('record')) + len(rules('alert'))} rules found" in r.stdout, r.stdout
    # the schema is strict enough to catch a misplaced field
    bad = copy.deepcopy(rule)
    bad["spec"]["groups"][0]["rules"][0]["severity"] = "critical"  # belongs under labels
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, PROMETHEUSRULE_SCHEMA)


def test_the_paging_error_ratio_leaves_out_exactly_what_requests_cause():
    """PdproxyStageErrorRatioHigh pages on instance faults only: its recording rule leaves out every
    error type the proxy counts as the request's doing (pdproxy/errors.py), and admission refusals."""
    from pdproxy.errors import CLIENT_CAUSED

    expr = rules("record")["run_model_deployment_stage:pdproxy_request_errors_upstream:ratio_rate5m"]["expr"]
    left_out = set(re.search(r'error_type!~"([^"]+)"', expr).group(1).split("|"))
    assert left_out == CLIENT_CAUSED | {"overloaded", "queue_timeout"}
    assert CLIENT_CAUSED <= error_types()  # each one documented in docs/reference/telemetry.md
