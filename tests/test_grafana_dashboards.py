"""Static checks of the generated Grafana dashboards and their provisioning.

The live counterpart (every PromQL expression executed against a real Prometheus that scraped a
real proxy) is tests/test_prometheus_live.py; the helpers here are shared with it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import procs

REPO = Path(__file__).resolve().parents[1]
GRAFANA = REPO / "grafana"
DASHBOARD_DIR = GRAFANA / "dashboards"
CONTRACT = REPO / "docs" / "reference" / "telemetry.md"
COLLECTOR = REPO / "collector" / "otelcol.yaml"
COMPOSE = REPO / "deploy" / "compose.yaml"


# ---------------------------------------------------------------------------------------------
# Helpers (also used by test_prometheus_live.py)


def load_dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows keep their panels inside
    return out


def prom_targets(dashboard: dict) -> list[tuple[dict, dict]]:
    return [(p, t) for p in panels(dashboard) for t in p.get("targets", []) if t["datasource"]["type"] == "prometheus"]


def tempo_targets(dashboard: dict) -> list[tuple[dict, dict]]:
    return [(p, t) for p in panels(dashboard) for t in p.get("targets", []) if t["datasource"]["type"] == "tempo"]


def variable_values(dashboard: dict) -> dict[str, str]:
    """What Grafana substitutes by default: `All` (the allValue regex) or the current custom value."""
    values = {}
    for v in dashboard["templating"]["list"]:
        values[v["name"]] = v.get("allValue", ".*") if v["type"] == "query" else v["current"]["value"]
    return values


def substitute(text: str, values: dict[str, str], rate_interval: str) -> str:
    text = text.replace("$__rate_interval", rate_interval).replace("$__interval", rate_interval)
    text = text.replace("$__range", rate_interval)
    for name in sorted(values, key=len, reverse=True):
        text = text.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    assert "$" not in text, f"unsubstituted variable in {text}"
    return text


PROMQL_WORDS = {"by", "without", "ignoring", "on", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords or labels."""
    bare = re.sub(r'"[^"]*"', "", expr)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", bare)
    bare = re.sub(r"\b(by|without|ignoring|on)\s*\([^)]*\)", " ", bare)
    names = re.findall(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", bare)
    return {n for n in names if n not in PROMQL_WORDS}


def series_base(name: str) -> str:
    return re.sub(r"_(bucket|sum|count)$", "", name)


def contract_metrics() -> tuple[tuple[str, ...], dict[str, tuple[str, set[str]]]]:
    """docs/reference/telemetry.md: the base labels and {metric: (type, extra labels)} of the metrics table."""
    text = CONTRACT.read_text()
    line = next(l for l in text.splitlines() if l.startswith("Labels are low-cardinality only:"))
    para = text[text.index(line):text.index("Never request or trace ids")]
    base = tuple(re.findall(r"`([a-z_]+)`", re.sub(r"\([^)]*\)", "", para.split("plus")[0])))
    metrics = {}
    for row in re.findall(r"^\| `(pdproxy_[a-z0-9_]+)` \| (\w+) \| ([^|]*)\|", text, flags=re.M):
        name, kind, extra = row
        metrics[name] = (kind, set(re.findall(r"`([a-z_]+)`", re.sub(r"\([^)]*\)", "", extra))))
    return base, metrics


def contract_span_attributes() -> set[str]:
    """Every attribute name in backticks in the span sections of docs/reference/telemetry.md."""
    text = CONTRACT.read_text()
    spans = text[:text.index("## Prometheus metrics")]
    return {a for a in re.findall(r"`([a-z_]+(?:\.[a-z0-9_]+)+)`", spans)}


# ---------------------------------------------------------------------------------------------
# The generator and its check mode


def test_committed_dashboards_match_the_generator():
    r = subprocess.run([sys.executable, str(GRAFANA / "generate.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_check_mode_fails_on_drift(tmp_path):
    shutil.copy(GRAFANA / "generate.py", tmp_path / "generate.py")
    shutil.copytree(DASHBOARD_DIR, tmp_path / "dashboards")
    target = tmp_path / "dashboards" / "pdproxy-overview.json"
    target.write_text(target.read_text().replace("TTFT p50 / p90 / p99", "TTFT p50 / p99", 1))
    r = subprocess.run([sys.executable, str(tmp_path / "generate.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 1
    assert "pdproxy-overview.json" in r.stderr and "-      \"title\": \"TTFT p50 / p99\"" in r.stdout
    # and regenerating repairs it
    subprocess.run([sys.executable, str(tmp_path / "generate.py")], check=True, capture_output=True)
    assert subprocess.run([sys.executable, str(tmp_path / "generate.py"), "--check"], capture_output=True).returncode == 0


# ---------------------------------------------------------------------------------------------
# The JSON model


@pytest.mark.parametrize("name", sorted(load_dashboards()))
def test_dashboard_model(name):
    d = load_dashboards()[name]
    assert 39 <= d["schemaVersion"] <= 41
    assert d["uid"] and d["title"]
    ids = [p["id"] for p in panels(d)]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in panels(d):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))
        if p["type"] == "row":
            continue
        if p["type"] == "alertlist":  # reads Prometheus's rules, no queries: see test_alert_list_and_annotations
            assert p.get("description") and "targets" not in p, p["title"]
            continue
        assert p["datasource"]["uid"] in {"prometheus", "tempo"}, p["title"]
        assert p.get("description"), f"{p['title']} has no description"
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == {"type": "prometheus", "uid": "prometheus"} or t["datasource"] == {"type": "tempo", "uid": "tempo"}
    names = {v["name"] for v in d["templating"]["list"]}
    assert {"model", "deployment", "run"} <= names


def test_overview_has_the_required_panels():
    d = load_dashboards()["pdproxy-overview.json"]
    exprs = {p["title"]: " ".join(t.get("expr", t.get("query", "")) for t in p.get("targets", [])) for p in panels(d)}

    def panel(pattern: str, *needles: str) -> str:
        hits = [t for t, e in exprs.items() if re.search(pattern, t) and all(n in e for n in needles)]
        assert hits, f"no panel /{pattern}/ using {needles}"
        return hits[0]

    panel("Requests/s by HTTP status", "pdproxy_requests_total", "by (code)")
    panel("by failed stage", "pdproxy_requests_total", "by (failed_stage)", 'failed_stage!="none"')
    panel("TTFT p50 / p90 / p99", "histogram_quantile(0.5,", "histogram_quantile(0.9,", "histogram_quantile(0.99,", "pdproxy_ttft_seconds_bucket")
    panel("stage split", "pdproxy_stage_duration_seconds_sum", "queue|prefill|kv_transfer")
    panel("Pooled ITL vs TPOT", "pdproxy_itl_seconds_bucket", "pdproxy_tpot_seconds_bucket")
    panel("Tail ITL distribution", "pdproxy_request_itl_max_seconds_bucket")
    panel("Tail ITL across requests", "pdproxy_request_itl_p99_seconds_bucket")
    panel("stall", "pdproxy_requests_with_stall_total")
    panel("kv_transfer", 'stage="kv_transfer"')
    panel("KV wait and compute", "pdproxy_trace_decode_kv_wait_seconds_bucket",
          "pdproxy_trace_decode_first_step_seconds_bucket", "pdproxy_trace_decode_intake_seconds_bucket")
    panel("Tokens/s", "pdproxy_tokens_total")
    panel("per instance", "pdproxy_instance_inflight")
    # an instance that fails while retries or migration save its requests shows by its attempts (issue 29)
    panel("Attempts/s per instance", "pdproxy_instance_attempts_total", "by (role, server_address)")
    panel("Failed attempts/s per instance", "pdproxy_instance_attempt_failures_total",
          "by (role, server_address, reason)")
    panel("Share of attempts that failed", "pdproxy_instance_attempt_failures_total",
          "pdproxy_instance_attempts_total")
    panel("moved away and hand-offs abandoned", "pdproxy_instance_moved_away_total",
          "pdproxy_instance_abandoned_handoffs_total")
    panel("by deployment", "by (le, deployment)")
    table = panel("Slowest requests", "span.gen_ai.response.time_to_first_chunk")
    assert next(p for p in panels(d) if p["title"] == table)["targets"][0]["tableType"] == "traces"


ITL_METRICS = ("pdproxy_itl_seconds", "pdproxy_tpot_seconds", "pdproxy_request_itl", "pdproxy_requests_with_stall",
               "pdproxy_trace_request_itl", "pdproxy_trace_requests_stalled", "span.pd.itl")


@pytest.mark.parametrize("name", sorted(load_dashboards()))
def test_every_itl_panel_says_which_definition(name):
    for p in panels(load_dashboards()[name]):
        text = " ".join(t.get("expr", t.get("query", "")) for t in p.get("targets", []))
        if any(m in text for m in ITL_METRICS):
            assert "ITL definition:" in p["description"], p["title"]
            assert re.search(r"\[(pooled ITL|TPOT|per-request (max|p99)[^\]]*)|stall", p["title"]), p["title"]


def test_latency_quantile_panels_carry_one_exemplar_query():
    d = load_dashboards()["pdproxy-overview.json"]
    for p in panels(d):
        if p["type"] != "timeseries" or not any("histogram_quantile" in t.get("expr", "") for t in p["targets"]):
            continue
        assert sum(bool(t.get("exemplar")) for t in p["targets"]) == 1, p["title"]


def test_overview_uses_only_contract_metrics_and_labels():
    base, metrics = contract_metrics()
    assert base == ("route", "model", "mode", "deployment", "run")
    collector_series, collector_labels = collector_prometheus_names()
    for p, t in prom_targets(load_dashboards()["pdproxy-overview.json"]):
        expr = t["expr"]
        used = {series_base(m) for m in metric_names(expr)}
        assert used, expr
        allowed = {"le"}
        for m in used:
            if m not in metrics and m + "_bucket" in collector_series:  # derived by the collector from spans
                allowed |= collector_labels
                continue
            assert m in metrics, f"{p['title']}: {m} is not in docs/reference/telemetry.md nor produced by the collector"
            allowed |= set(base) | metrics[m][1]
        labels = set(re.findall(r"([a-z_]+)\s*(?:=~|!~|!=|=)\s*\"", expr))
        for group in re.findall(r"\b(?:by|ignoring|on)\s*\(([^)]*)\)", expr):
            labels |= {l.strip() for l in group.split(",") if l.strip()}
        assert labels <= allowed, f"{p['title']}: labels {labels - allowed} not in the contract for {used}"
    for v in load_dashboards()["pdproxy-overview.json"]["templating"]["list"]:
        if v["type"] == "query":
            metric, label = re.fullmatch(r"label_values\((\w+)(?:\{.*\})?, *(\w+)\)", v["definition"]).groups()
            assert metric in metrics and label in set(base) | metrics[metric][1], v["definition"]


def test_threshold_variables_are_bucket_bounds():
    sys.path.insert(0, str(REPO))
    from pdproxy.telemetry.names import GAP_BUCKETS, LATENCY_BUCKETS

    for d in load_dashboards().values():
        for v in d["templating"]["list"]:
            if v["name"] == "stall":
                assert {float(o["value"]) for o in v["options"]} <= set(GAP_BUCKETS)
            if v["name"] == "ttft_slo":
                assert {float(o["value"]) for o in v["options"]} <= set(LATENCY_BUCKETS)
            # the exposition writes bounds as Go floats: 1 -> "1.0", 0.1 -> "0.1"
            for o in v.get("options", []):
                assert o["value"] == repr(float(o["value"])), o


def test_every_promql_expression_parses_with_promtool(tmp_path):
    promtool = shutil.which("promtool")
    if not promtool:
        pytest.skip("promtool not installed (Debian package prometheus; .ci/run installs it)")
    rules, n = [], 0
    for name, d in load_dashboards().items():
        values = variable_values(d)
        for p, t in prom_targets(d):
            n += 1
            rules.append({"record": f"pdproxy_dashboard:q{n}", "expr": substitute(t["expr"], values, "1m")})
        for v in d["templating"]["list"]:
            if v["type"] == "query":
                inner = re.fullmatch(r"label_values\((.*), *\w+\)", v["definition"]).group(1)
                if inner.startswith("pdproxy") or "{" in inner:
                    n += 1
                    rules.append({"record": f"pdproxy_dashboard:q{n}", "expr": substitute(inner, values, "1m")})
        for a in d["annotations"]["list"]:
            if a["datasource"].get("type") == "prometheus":
                n += 1
                rules.append({"record": f"pdproxy_dashboard:q{n}", "expr": a["expr"]})
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0 and f"SUCCESS: {n} rules found" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("name", sorted(load_dashboards()))
def test_alert_list_and_annotations(name):
    """Firing alerts show on both dashboards: an alert list panel reading the Prometheus data source's
    rules (by the name provisioning gives it) and an annotation query on Prometheus's ALERTS series."""
    d = load_dashboards()[name]
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "datasources.yaml").read_text())["datasources"]
    prom_name = next(s["name"] for s in ds if s["uid"] == "prometheus")
    alert_rules = yaml.safe_load((REPO / "deploy" / "prometheus" / "rules" / "pdproxy-alerts.yml").read_text())
    alerts = [r["alert"] for g in alert_rules["groups"] for r in g["rules"]]
    (panel,) = [p for p in panels(d) if p["type"] == "alertlist"]
    options = panel["options"]
    assert options["datasource"] == prom_name
    assert alerts and all(a.lower().startswith(options["alertName"].lower()) for a in alerts)
    assert options["stateFilter"]["firing"] and not options["stateFilter"]["normal"]
    assert panel["gridPos"]["y"] <= 4, "the alert list belongs at the top"
    (annotation,) = [a for a in d["annotations"]["list"] if a["datasource"].get("type") == "prometheus"]
    assert annotation["enable"] and annotation["expr"].startswith('ALERTS{alertstate="firing"')
    assert re.search(r'alertname=~"(\w+)\.\+"', annotation["expr"]).group(1) == options["alertName"]


# ---------------------------------------------------------------------------------------------
# TraceQL (no Tempo here: syntax only)

TRACEQL_INTRINSICS = {"duration", "name", "kind", "status", "statusMessage", "rootName", "rootServiceName", "traceDuration"}


def traceql_queries() -> list[tuple[str, str]]:
    out = []
    for d in load_dashboards().values():
        values = variable_values(d)
        for p, t in tempo_targets(d):
            out.append((p["title"], substitute(t["query"], values, "1m")))
    return out


def test_traceql_shape_and_attributes():
    known = contract_span_attributes()
    queries = traceql_queries()
    assert len(queries) >= 3
    for title, q in queries:
        assert re.match(r"^\{ .+ \}( \| [a-z_]+\(.*\)( by \([a-z._, ]+\))?)?$", q), q
        depth = 0
        for ch in q:
            depth += {"{": 1, "(": 1, "}": -1, ")": -1}.get(ch, 0)
            assert depth >= 0, q
        assert depth == 0 and q.count('"') % 2 == 0, q
        for attr in re.findall(r"\bspan\.([a-z_][a-z0-9_.]*[a-z0-9_])", q):
            assert attr in known, f"{title}: span.{attr} is not in docs/reference/telemetry.md"


def _lezer_traceql(tmp_cache: Path):
    """Grafana's own TraceQL grammar (npm @grafana/lezer-traceql), when node and npm are here."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        return None
    pkg = tmp_cache / "node_modules" / "@grafana" / "lezer-traceql"
    if not pkg.exists():
        r = procs.run([npm, "install", "--silent", "--no-audit", "--no-fund", "--prefix", str(tmp_cache),
                       "@grafana/lezer-traceql@1.0.0", "@lezer/lr@1.4.2"], timeout=120)  # npm's children too
        if r.returncode != 0:
            return None
    return node


def test_traceql_parses_with_grafanas_grammar(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp().parent / "pdproxy-npm-cache"
    cache.mkdir(exist_ok=True)
    node = _lezer_traceql(cache)
    if node is None:
        pytest.skip("node/npm or the npm registry unavailable: TraceQL checked by shape only")
    script = cache / "parse.cjs"
    script.write_text(
        'const { parser } = require("@grafana/lezer-traceql");\n'
        'const qs = JSON.parse(require("fs").readFileSync(0, "utf8"));\n'
        "const out = qs.map((q) => { const errors = [];\n"
        "  parser.parse(q).iterate({ enter: (n) => { if (n.type.isError) errors.push(n.from); } });\n"
        "  return errors; });\n"
        "console.log(JSON.stringify(out));\n")
    queries = [q for _, q in traceql_queries()] + ["{ span.pd.itl.max > } | select("]  # the last must fail
    r = subprocess.run([node, str(script)], input=json.dumps(queries), capture_output=True, text=True, cwd=cache)
    assert r.returncode == 0, r.stderr
    errors = json.loads(r.stdout)
    assert errors[-1], "the grammar accepted a broken query: the check is not working"
    for q, e in zip(queries[:-1], errors[:-1]):
        assert not e, f"TraceQL syntax error at {e} in {q}"


# ---------------------------------------------------------------------------------------------
# The trace-derived dashboard reads what the collector configuration produces


def collector_prometheus_names() -> tuple[set[str], set[str]]:
    """Series and label names the collector's Prometheus exporter would expose, by its documented
    translation (UnderscoreEscapingWithSuffixes): dots -> underscores, unit `s` -> `_seconds`,
    monotonic sums -> `_total`, histograms -> `_bucket`/`_sum`/`_count`."""
    cfg = yaml.safe_load(COLLECTOR.read_text())
    prom = cfg["exporters"]["prometheus"]
    assert prom["translation_strategy"] == "UnderscoreEscapingWithSuffixes"

    def label(key: str) -> str:
        return re.sub(r"[^a-zA-Z0-9_]", "_", key)

    series, labels = set(), {"le", "job", "instance"}
    labels |= {label(k) for k in prom["resource_constant_labels"]["included"]}
    for m in cfg["connectors"]["signal_to_metrics"]["spans"]:
        name = label(m["name"]) + ("_seconds" if m.get("unit") == "s" else "")
        if "histogram" in m:
            series |= {name + s for s in ("_bucket", "_sum", "_count")}
        else:
            assert m["sum"]["monotonic"]
            series.add(name + "_total")
        labels |= {label(a["key"]) for a in m.get("attributes", [])}
    sm = cfg["connectors"]["span_metrics"]
    ns = label(sm["namespace"])
    assert sm["histogram"]["unit"] == "s"
    series |= {f"{ns}_duration_seconds{s}" for s in ("_bucket", "_sum", "_count")} | {f"{ns}_calls_total"}
    labels |= {"service_name", "span_name", "span_kind", "status_code"} | {label(d["name"]) for d in sm["dimensions"]}
    return series, labels


def test_trace_dashboard_reads_what_the_collector_produces():
    series, labels = collector_prometheus_names()
    _, proxy_metrics = contract_metrics()
    d = load_dashboards()["pdproxy-traces.json"]
    used_collector = set()
    for p, t in prom_targets(d):
        for m in metric_names(t["expr"]):
            if series_base(m) in proxy_metrics:
                continue  # the proxy's own series, drawn for comparison
            assert m in series, f"{p['title']}: {m} is not produced by collector/otelcol.yaml"
            used_collector.add(m)
            for sel in re.findall(re.escape(m) + r"\{([^}]*)\}", t["expr"]):
                used = set(re.findall(r"([a-z_]+)\s*(?:=~|!~|!=|=)", sel))
                assert used <= labels, f"{p['title']}: {used - labels} not produced for {m}"
    assert {"traces_span_metrics_duration_seconds_bucket", "pdproxy_trace_ttft_seconds_bucket",
            "pdproxy_trace_request_itl_max_seconds_bucket"} <= used_collector


# ---------------------------------------------------------------------------------------------
# Provisioning


def test_datasource_provisioning():
    path = GRAFANA / "provisioning" / "datasources" / "datasources.yaml"
    raw = path.read_text()
    cfg = yaml.safe_load(raw)
    assert cfg["apiVersion"] == 1
    by_uid = {ds["uid"]: ds for ds in cfg["datasources"]}
    assert by_uid["prometheus"]["type"] == "prometheus" and by_uid["tempo"]["type"] == "tempo"
    dest = by_uid["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert dest == [{"name": "trace_id", "datasourceUid": "tempo", "urlDisplayLabel": "Trace: $${__value.raw}"},
                    {"name": "trace_id", "datasourceUid": "jaeger", "urlDisplayLabel": "Jaeger: $${__value.raw}"}]
    assert by_uid["jaeger"]["type"] == "jaeger"
    body = "\n".join(l for l in raw.splitlines() if not l.lstrip().startswith("#"))
    assert "$${__value.raw}" in body and "${__value.raw}" not in body.replace("$${__value.raw}", "")
    assert by_uid["tempo"]["jsonData"]["serviceMap"]["datasourceUid"] == "prometheus"
    # every datasource a dashboard names is provisioned
    for d in load_dashboards().values():
        for p in panels(d):
            for t in p.get("targets", []):
                assert t["datasource"]["uid"] in by_uid
    # $__rate_interval assumes timeInterval = the scrape interval of the compose Prometheus
    prom_cfg = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert by_uid["prometheus"]["jsonData"]["timeInterval"] == prom_cfg["global"]["scrape_interval"]
    # and the URLs name the compose services
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for ds in cfg["datasources"]:
        host = re.match(r"http://([a-z-]+):\d+$", ds["url"]).group(1)
        assert host in services


def test_dashboard_provider_matches_the_compose_mounts():
    cfg = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "pdproxy.yaml").read_text())
    (provider,) = cfg["providers"]
    assert provider["type"] == "file"
    grafana = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"] if v.startswith(".."))
    assert mounts["../grafana/dashboards"] == provider["options"]["path"]
    assert mounts["../grafana/provisioning"] == "/etc/grafana/provisioning"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(provider["options"]["path"] + "/") and (DASHBOARD_DIR / Path(home).name).exists()


def _requests(run: str, deployment: str, failed_stage: str, values: str) -> dict:
    labels = (f'job="pdproxy", route="completions", model="m", mode="pd", run="{run}", deployment="{deployment}", '
              f'code="{200 if failed_stage == "none" else 502}", failed_stage="{failed_stage}"')
    return {"series": f"pdproxy_requests_total{{{labels}}}", "values": values}


@pytest.mark.parametrize("series, overall, by_deployment", [
    # a healthy proxy has no failed-stage series at all: 0, not "No data"
    ([("primary", "none", "0+60x20"), ("shadow", "none", "0+30x20")], 0, {"primary": 0, "shadow": 0}),
    # no traffic in the window: 0, not 0/0 = NaN
    ([("primary", "none", "100+0x20"), ("primary", "prefill", "3+0x20")], 0, {"primary": 0}),
    # failures: their share, of all deployments in the stat, per deployment in the time series
    ([("primary", "none", "0+54x20"), ("primary", "decode", "0+6x20"), ("shadow", "none", "0+30x20")], 0.0667,
     {"primary": 0.1, "shadow": 0}),
], ids=["healthy", "idle", "failing"])
def test_failed_request_panels_read_0_without_failures(tmp_path, series, overall, by_deployment):
    promtool = shutil.which("promtool")
    if not promtool:
        pytest.skip("promtool not installed (Debian package prometheus; .ci/run installs it)")
    d = load_dashboards()["pdproxy-overview.json"]
    values = variable_values(d)

    def expr(title: str) -> str:
        (p,) = [p for p in panels(d) if p["title"] == title]
        return f'round({substitute(p["targets"][0]["expr"], values, "5m")}, 0.0001)'

    tests = [{"interval": "1m", "input_series": [_requests("r", *s) for s in series], "promql_expr_test": [
        {"expr": expr("Failed requests"), "eval_time": "15m", "exp_samples": [{"labels": "{}", "value": overall}]},
        {"expr": expr("Error ratio by deployment"), "eval_time": "15m",
         "exp_samples": [{"labels": f'{{deployment="{dep}"}}', "value": v} for dep, v in by_deployment.items()]},
    ]}]
    path = tmp_path / "panels.test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m", "tests": tests}))
    r = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
