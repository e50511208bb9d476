"""Generate pdproxy's Grafana dashboards (Classic JSON model) from plain Python.

    python grafana/generate.py           # write grafana/dashboards/*.json
    python grafana/generate.py --check   # exit 1 when the committed JSON differs

Metric and label names are the contract in docs/reference/telemetry.md; span attributes in the TraceQL
panels come from the same document. Datasources are referenced by the fixed uids that
grafana/provisioning/datasources/datasources.yaml provisions: `prometheus` and `tempo`.

Three ITL definitions appear side by side and every panel that shows one says which:
  * pooled ITL   every gap between consecutive token-bearing chunks of every request, in one
                 distribution (what vLLM and SGLang call ITL);
  * TPOT         one value per request, its mean gap: (last token - first token) / (tokens - 1);
  * tail ITL     one value per request, the largest gap (or the p99 of its own gaps), then
                 percentiles across requests: "what share of users saw a stall".
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "dashboards"

SCHEMA_VERSION = 39  # Classic JSON; Grafana 11 and later load it as is (13 migrates on load)
PROM = {"type": "prometheus", "uid": "prometheus"}
TEMPO = {"type": "tempo", "uid": "tempo"}

# Bucket bounds offered by the threshold variables. PromQL can only count "at most X" at an
# exact bucket bound, so these strings are `le` values of the proxy's histograms
# (pdproxy/telemetry/names.py, formatted as the exposition formats them).
STALL_CHOICES = ["0.05", "0.1", "0.2", "0.25", "0.5", "1.0"]  # GAP_BUCKETS; proxy default stall threshold 0.1
TTFT_SLO_CHOICES = ["0.25", "0.5", "1.0", "2.0", "5.0"]  # LATENCY_BUCKETS

ITL_DEFINITIONS = {
    "pooled": "ITL definition: pooled — every gap between consecutive token-bearing chunks of every "
              "request, in one distribution (vLLM's ITL). Long requests dominate its percentiles.",
    "tpot": "ITL definition: TPOT — one value per request, its mean gap "
            "(last token − first token) / (output tokens − 1). Hides stalls inside a request.",
    "tail_max": "ITL definition: per-request tail ITL (max) — each request's largest gap, then "
                "percentiles across requests: p99 = 99% of requests never waited longer than this "
                "between two tokens.",
    "tail_p99": "ITL definition: per-request tail ITL (p99) — the p99 of each request's own gaps "
                "(numpy linear), then percentiles across requests.",
    "stall": "ITL definition: stall — a request stalled when its largest gap exceeds the threshold "
             "(per-request tail ITL, max).",
}


# ---------------------------------------------------------------------------------------------
# PromQL helpers: the patterns every panel uses, written once.


def selector(*matchers: str, base: tuple[str, ...] = ()) -> str:
    both = [*base, *matchers]
    return "{" + ", ".join(both) + "}" if both else ""


@dataclass(frozen=True)
class Scope:
    """The label matchers that the dashboard's template variables put on every series."""

    matchers: tuple[str, ...]

    def sel(self, *extra: str) -> str:
        return selector(*extra, base=self.matchers)

    def rate(self, metric: str, *extra: str, by: str = "") -> str:
        grouping = f" by ({by})" if by else ""
        return f"sum{grouping} (rate({metric}{self.sel(*extra)}[$__rate_interval]))"

    def quantile(self, q: float, histogram: str, *extra: str, by: str = "") -> str:
        labels = f"le, {by}" if by else "le"
        return f"histogram_quantile({q}, sum by ({labels}) (rate({histogram}_bucket{self.sel(*extra)}[$__rate_interval])))"

    def mean(self, histogram: str, *extra: str, by: str = "") -> str:
        return f"{self.rate(histogram + '_sum', *extra, by=by)} / {self.rate(histogram + '_count', *extra, by=by)}"

    def share_above(self, histogram: str, bound: str, *extra: str, by: str = "") -> str:
        """Share of observations above an exact bucket bound: 1 - (at most bound) / all."""
        at_most = self.rate(histogram + "_bucket", f'le="{bound}"', *extra, by=by)
        return f"1 - ({at_most} / {self.rate(histogram + '_count', *extra, by=by)})"

    def share_at_most(self, histogram: str, bound: str, *extra: str, by: str = "") -> str:
        at_most = self.rate(histogram + "_bucket", f'le="{bound}"', *extra, by=by)
        return f"{at_most} / {self.rate(histogram + '_count', *extra, by=by)}"

    def heatmap(self, histogram: str, *extra: str) -> str:
        return f"sum by (le) (increase({histogram}_bucket{self.sel(*extra)}[$__rate_interval]))"


# The proxy's request-scoped series carry model, deployment and run (docs/reference/telemetry.md).
REQ = Scope(('model=~"$model"', 'deployment=~"$deployment"', 'run=~"$run"'))
# Gauges (in flight, queue, instance health), the shadow and span-drop counters are per process
# and carry only their own labels (pdproxy/telemetry/metrics.py): no request scope on those.
# Primary vs shadow panels compare deployments, so they do not filter on it.
BOTH = Scope(('model=~"$model"', 'run=~"$run"'))
# Stall attribution counters carry mode, deployment, run and cause, no model (docs/reference/telemetry.md).
STALLS = Scope(('deployment=~"$deployment"', 'run=~"$run"'))
# Span-derived series from the collector: attribute names translated by its Prometheus exporter.
TRACE = Scope(('gen_ai_request_model=~"$model"', 'pd_deployment=~"$deployment"', 'pd_run=~"$run"'))
SPANS = Scope(('service_name="pdproxy"', 'pd_run=~"$run"'))  # span_metrics
RUN = Scope(('pd_run=~"$run"',))  # signal_to_metrics series without request attributes
VLLM = Scope(())  # signal_to_metrics series from vLLM's llm_request spans: only service_name (the instance)


# ---------------------------------------------------------------------------------------------
# Panels and layout.


def prom(expr: str, legend: str = "", *, exemplar: bool = False, fmt: str = "time_series") -> dict:
    target = {"datasource": PROM, "expr": expr, "legendFormat": legend or "__auto", "range": True}
    if exemplar:
        target["exemplar"] = True
    if fmt != "time_series":
        target["format"] = fmt
    return target


def traceql(query: str, *, table: str = "traces", limit: int = 20) -> dict:
    return {"datasource": TEMPO, "queryType": "traceql", "query": query, "tableType": table, "limit": limit,
            "filters": []}


def traceql_metrics(query: str, step: str = "1m") -> dict:
    return {"datasource": TEMPO, "queryType": "traceql", "query": query, "metricsQueryType": "range", "step": step,
            "filters": []}


def field_config(unit: str, *, stack: bool = False, max_: float | None = None) -> dict:
    defaults: dict = {"unit": unit, "min": 0, "custom": {"fillOpacity": 10, "showPoints": "never", "spanNulls": True}}
    if stack:
        defaults["custom"].update({"stacking": {"mode": "normal", "group": "A"}, "fillOpacity": 60})
    if max_ is not None:
        defaults["max"] = max_
    return {"defaults": defaults, "overrides": []}


def timeseries(title: str, description: str, targets: list[dict], unit: str = "s", **kw) -> dict:
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": targets[0]["datasource"],
        "targets": targets,
        "fieldConfig": field_config(unit, **kw),
        "options": {"legend": {"showLegend": True, "displayMode": "table", "placement": "bottom",
                               "calcs": ["lastNotNull", "max"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
    }


def stat(title: str, description: str, target: dict, unit: str, *, decimals: int = 3) -> dict:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": target["datasource"],
        "targets": [target],
        "fieldConfig": {"defaults": {"unit": unit, "decimals": decimals}, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "none", "graphMode": "area", "textMode": "value", "justifyMode": "auto",
                    "orientation": "auto", "wideLayout": True, "showPercentChange": False,
                    "percentChangeColorMode": "standard"},
    }


def heatmap(title: str, description: str, target: dict) -> dict:
    return {
        "type": "heatmap",
        "title": title,
        "description": description,
        "datasource": target["datasource"],
        "targets": [target],
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {"calculate": False, "yAxis": {"unit": "s"}, "cellGap": 1, "showValue": "auto",
                    "color": {"mode": "scheme", "scheme": "Oranges", "fill": "dark-orange", "exponent": 0.5,
                              "steps": 64, "reverse": False},
                    "legend": {"show": True}, "exemplars": {"color": "rgba(255,0,255,0.7)"},
                    "tooltip": {"mode": "single", "yHistogram": True}},
    }


def trace_table(title: str, description: str, target: dict) -> dict:
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": target["datasource"],
        "targets": [target],
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {"showHeader": True, "cellHeight": "sm", "frameIndex": 0},
    }


# Alerts: the rules in deploy/prometheus/rules/ are evaluated by Prometheus (data source-managed
# rules); Grafana's alert list panel reads them from the Prometheus data source by its *name*.
PROM_DATASOURCE_NAME = "Prometheus"  # grafana/provisioning/datasources/datasources.yaml
ALERT_PREFIX = "Pdproxy"  # every alert in deploy/prometheus/rules/pdproxy-alerts.yml
FIRING_ALERTS = f'ALERTS{{alertstate="firing", alertname=~"{ALERT_PREFIX}.+"}}'


def alert_list(title: str, description: str) -> dict:
    """Firing and pending pdproxy alerts; runbooks in docs/reference/runbooks.md (each alert's runbook_url)."""
    return {
        "type": "alertlist",
        "title": title,
        "description": description,
        "options": {
            "viewMode": "list",
            "groupMode": "default",
            "groupBy": [],
            "maxItems": 20,
            "sortOrder": 3,  # importance: firing first
            "dashboardAlerts": False,
            "alertName": ALERT_PREFIX,
            "alertInstanceLabelFilter": "",
            "datasource": PROM_DATASOURCE_NAME,
            "stateFilter": {"firing": True, "pending": True, "noData": False, "normal": False, "error": True},
            "showInstances": True,
        },
    }


def alert_annotation() -> dict:
    """Firing pdproxy alerts as annotations on every time series panel (ALERTS is Prometheus's own series)."""
    return {"datasource": PROM, "enable": True, "expr": FIRING_ALERTS, "iconColor": "red", "name": "pdproxy alerts",
            "step": "15s", "titleFormat": "{{alertname}}", "tagKeys": "severity", "useValueForTime": False,
            "textFormat": "{{severity}} run={{run}} model={{model}} stage={{stage}} role={{role}} {{server_address}}"}


@dataclass
class Layout:
    """Packs panels left to right on Grafana's 24-column grid, wrapping to a new line when full."""

    panels: list[dict] = field(default_factory=list)
    x: int = 0
    y: int = 0
    line_height: int = 0

    def row(self, title: str) -> None:
        self._newline()
        self._place({"type": "row", "title": title, "collapsed": False, "panels": []}, 24, 1)
        self._newline()

    def add(self, panel: dict, w: int = 12, h: int = 8) -> None:
        if self.x + w > 24:
            self._newline()
        self._place(panel, w, h)

    def _place(self, panel: dict, w: int, h: int) -> None:
        panel["id"] = len(self.panels) + 1
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.panels.append(panel)
        self.x += w
        self.line_height = max(self.line_height, h)

    def _newline(self) -> None:
        if self.x:
            self.y += self.line_height
        self.x, self.line_height = 0, 0


# ---------------------------------------------------------------------------------------------
# Template variables.


def query_variable(name: str, label: str, query: str) -> dict:
    return {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": PROM,
        "definition": query,
        "query": {"query": query, "refId": f"var-{name}"},
        "refresh": 2,  # on time range change
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def custom_variable(name: str, label: str, choices: list[str], default: str, description: str) -> dict:
    return {
        "type": "custom",
        "name": name,
        "label": label,
        "description": description,
        "query": ",".join(choices),
        "options": [{"selected": c == default, "text": c, "value": c} for c in choices],
        "current": {"selected": True, "text": default, "value": default},
        "multi": False,
        "includeAll": False,
    }


def proxy_variables() -> list[dict]:
    return [
        query_variable("run", "Run label", "label_values(pdproxy_requests_total, run)"),
        query_variable("model", "Model", 'label_values(pdproxy_requests_total{run=~"$run"}, model)'),
        query_variable("deployment", "Deployment", 'label_values(pdproxy_requests_total{run=~"$run"}, deployment)'),
        custom_variable("stall", "Stall above (s)", STALL_CHOICES, "0.1",
                        "A gap longer than this is a stall. Exact bucket bounds of the gap histograms only."),
        custom_variable("ttft_slo", "TTFT SLO (s)", TTFT_SLO_CHOICES, "0.5",
                        "TTFT target. Exact bucket bounds of the latency histograms only."),
    ]


def dashboard(uid: str, title: str, description: str, panels: list[dict], variables: list[dict], links: list[dict]) -> dict:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["pdproxy", "vllm", "prefill-decode"],
        "editable": True,
        "graphTooltip": 1,  # shared crosshair
        "timezone": "browser",
        "time": {"from": "now-30m", "to": "now"},
        "refresh": "10s",
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "links": links,
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard",
        }, alert_annotation()]},
        "templating": {"list": variables},
        "panels": panels,
    }


def link_to(uid: str, title: str) -> dict:
    return {"type": "link", "title": title, "url": f"/d/{uid}", "keepTime": True, "includeVars": True,
            "icon": "dashboard", "targetBlank": False, "asDropdown": False, "tags": [], "tooltip": ""}


# ---------------------------------------------------------------------------------------------
# Dashboard 1: everything the proxy measures itself (GET /metrics), plus the worst traces.

OVERVIEW_UID = "pdproxy-overview"
TRACES_UID = "pdproxy-traces"

# Root-span attributes shown in the trace tables (docs/reference/telemetry.md).
TRACE_COLUMNS = ("span.gen_ai.response.time_to_first_chunk, span.pd.itl.max, span.pd.itl.p99, span.pd.e2e, "
                 "span.pd.stalls, span.pd.failed_stage, span.pd.prefill.instance, span.pd.decode.instance")
ROOT_FILTER = 'span.pd.run =~ "$run" && span.gen_ai.request.model =~ "$model" && span.pd.deployment =~ "$deployment"'


FAILED = 'failed_stage!="none"'


def share(part: str, whole: str) -> str:
    """`part / whole` that reads 0 while nothing of `part` happened: a counter of failures is only born
    at the first failure, so a healthy proxy has no such series ("No data"), and a whole of 0 (no
    traffic) would make 0/0 = NaN. Still "No data" when `whole` itself has no series (nothing scraped)."""
    return f"(({part} or 0 * {whole}) / ({whole} > 0)) or 0 * {whole}"


def quantiles(scope: Scope, histogram: str, label: str, *extra: str, qs=(0.5, 0.9, 0.99), exemplar_on=0.99) -> list[dict]:
    return [prom(scope.quantile(q, histogram, *extra), f"{label} p{round(q * 100)}", exemplar=q == exemplar_on) for q in qs]


def overview() -> dict:
    L = Layout()

    # Headline numbers.
    L.add(stat("Requests/s", "Requests that ended (ok or failed), all routes.",
               prom(REQ.rate("pdproxy_requests_total")), "reqps", decimals=2), w=4, h=4)
    L.add(stat("Failed requests", "Share of requests that failed in any stage (failed_stage != none). Never success-only.",
               prom(share(REQ.rate('pdproxy_requests_total', FAILED), REQ.rate('pdproxy_requests_total'))),
               "percentunit"), w=4, h=4)
    L.add(stat("TTFT p99", "Received → first token-bearing chunk, as the proxy sees it.",
               prom(REQ.quantile(0.99, "pdproxy_ttft_seconds")), "s"), w=4, h=4)
    L.add(stat("Tail ITL p99 [per-request max]", ITL_DEFINITIONS["tail_max"],
               prom(REQ.quantile(0.99, "pdproxy_request_itl_max_seconds")), "s"), w=4, h=4)
    L.add(stat("Requests with a stall", ITL_DEFINITIONS["stall"] + " Threshold: the proxy's --stall-threshold.",
               prom(f'{REQ.rate("pdproxy_requests_with_stall_total")} / {REQ.rate("pdproxy_request_itl_max_seconds_count")}'),
               "percentunit"), w=4, h=4)
    L.add(stat("Output tokens/s", "Output tokens from the instances' usage reports.",
               prom(REQ.rate("pdproxy_tokens_total", 'type="output"')), "short", decimals=1), w=4, h=4)

    L.add(alert_list("Firing alerts", "pdproxy alerts firing or pending in Prometheus (deploy/prometheus/rules/); "
                                      "each alert's runbook_url points at its entry in docs/reference/runbooks.md."), w=24, h=5)

    L.row("Traffic and errors")
    L.add(timeseries("Requests/s by HTTP status",
                     "Every request exactly once, when it ends, by the status the client got.",
                     [prom(REQ.rate("pdproxy_requests_total", by="code"), "{{code}}")], "reqps"), w=8)
    L.add(timeseries("Failed requests/s by failed stage",
                     "Failed requests by the stage that failed: queue, prefill, kv_transfer, decode, or client (went away).",
                     [prom(REQ.rate("pdproxy_requests_total", FAILED, by="failed_stage"), "{{failed_stage}}")],
                     "reqps", stack=True), w=8)
    L.add(timeseries("Error ratio by failed stage",
                     "Failed requests of each stage divided by all requests that ended.",
                     [prom(f"{REQ.rate('pdproxy_requests_total', FAILED, by='failed_stage')} "
                           f"/ ignoring(failed_stage) group_left {REQ.rate('pdproxy_requests_total')}", "{{failed_stage}}")],
                     "percentunit", stack=True), w=8)
    L.add(timeseries("Errors/s by stage and type",
                     "Failed requests by stage and error type (timeout, connect_error, upstream_5xx, kv_load_failed, ...).",
                     [prom(REQ.rate("pdproxy_request_errors_total", by="stage, error_type"), "{{stage}} {{error_type}}")],
                     "reqps", stack=True), w=24, h=7)

    L.row("TTFT: received → first token = queue + prefill + kv_transfer")
    L.add(timeseries("TTFT p50 / p90 / p99",
                     "Time to first token as the proxy sees it (successful first tokens). Exemplars on p99 link to traces.",
                     [*quantiles(REQ, "pdproxy_ttft_seconds", "TTFT"), prom(REQ.mean("pdproxy_ttft_seconds"), "TTFT mean")]), w=12)
    L.add(timeseries("TTFT stage split (mean per stage, stacked)",
                     "Mean duration of the stage spans that make up TTFT; stacked, they add up to the mean TTFT. "
                     "kv_transfer is an upper bound (hand-off + decode queue + KV pull + one decode step).",
                     [prom(REQ.mean("pdproxy_stage_duration_seconds", 'stage=~"queue|prefill|kv_transfer"', by="stage"), "{{stage}}")],
                     stack=True), w=12)
    L.add(timeseries("Stage p90 and p99 (queue, prefill, kv_transfer)",
                     "Percentiles per stage. Percentiles do not add up: use the stacked means for the split.",
                     [prom(REQ.quantile(q, "pdproxy_stage_duration_seconds", 'stage=~"queue|prefill|kv_transfer"', by="stage"),
                           f"{{{{stage}}}} p{round(q * 100)}", exemplar=q == 0.99) for q in (0.9, 0.99)]), w=12)
    L.add(timeseries("TTFT SLO attainment (TTFT ≤ $ttft_slo s)",
                     "Share of successful first tokens within the SLO variable (an exact bucket bound).",
                     [prom(REQ.share_at_most("pdproxy_ttft_seconds", "$ttft_slo"), "TTFT ≤ $ttft_slo s")],
                     "percentunit", max_=1), w=12)

    L.row("Inter-token latency: pooled vs TPOT vs per-request tail")
    L.add(timeseries("Pooled ITL vs TPOT [pooled ITL | TPOT]",
                     ITL_DEFINITIONS["pooled"] + " " + ITL_DEFINITIONS["tpot"] + " Gaps per token where the stream "
                     "gave per-chunk token counts (pdproxy_itl_seconds), else per chunk (pdproxy_chunk_gap_seconds): "
                     "two metrics, never blended.",
                     [*[prom(REQ.quantile(q, metric), f"pooled ITL p{round(q * 100)} (per {unit})", exemplar=q == 0.99 and unit == "token")
                        for metric, unit in (("pdproxy_itl_seconds", "token"), ("pdproxy_chunk_gap_seconds", "chunk"))
                        for q in (0.5, 0.99)],
                      *[prom(REQ.quantile(q, "pdproxy_tpot_seconds"), f"TPOT p{round(q * 100)}") for q in (0.5, 0.99)]]), w=12)
    L.add(timeseries("Tail ITL across requests [per-request max gap]",
                     ITL_DEFINITIONS["tail_max"],
                     quantiles(REQ, "pdproxy_request_itl_max_seconds", "max gap")), w=12)
    L.add(timeseries("Tail ITL across requests [per-request p99 gap]",
                     ITL_DEFINITIONS["tail_p99"],
                     quantiles(REQ, "pdproxy_request_itl_p99_seconds", "p99 gap")), w=8)
    L.add(heatmap("Tail ITL distribution [per-request max gap]",
                  ITL_DEFINITIONS["tail_max"] + " Requests per bucket of their largest gap.",
                  prom(REQ.heatmap("pdproxy_request_itl_max_seconds"), "{{le}}", fmt="heatmap")), w=8)
    L.add(timeseries("Share of requests with a stall [per-request max gap]",
                     ITL_DEFINITIONS["stall"] + " Two sources that should agree when $stall equals the proxy's "
                     "--stall-threshold: the proxy's stall counter, and the max-gap histogram above $stall.",
                     [prom(f'{REQ.rate("pdproxy_requests_with_stall_total")} / {REQ.rate("pdproxy_request_itl_max_seconds_count")}',
                           "stall counter"),
                      prom(REQ.share_above("pdproxy_request_itl_max_seconds", "$stall"), "max gap > $stall s")],
                     "percentunit", max_=1), w=8)

    L.row("Why streams stall (live attribution: what ran on the same instance during each gap)")
    cause_note = ("Each gap above the proxy's --stall-threshold is put down, when its stream ends, to what "
                  "overlapped it on the same instance (±10 ms): another request's KV arrival (P/D decode), "
                  "another request's prefill (single instance), a migration splice, a preemption the "
                  "instance reported, or none. The rule of `pdproxy report --traces` (docs/reference/report.md). ")
    L.add(timeseries("Stall time by cause (live) [stall]",
                     ITL_DEFINITIONS["stall"] + " " + cause_note + "Seconds of stall per second, stacked; "
                     "exemplars open a stalled request's trace, whose pd.decode links to its culprits.",
                     [prom(STALLS.rate("pdproxy_stall_seconds_total", by="cause"), "{{cause}}", exemplar=True)],
                     stack=True), w=8)
    L.add(timeseries("Share of stall time by cause (live) [stall]",
                     ITL_DEFINITIONS["stall"] + " " + cause_note + "What the alert DecodeStallsFromKVArrivals "
                     "reads: the kv_arrival share while the tail-ITL objective burns.",
                     [prom(f"{STALLS.rate('pdproxy_stall_seconds_total', by='cause')} "
                           f"/ ignoring(cause) group_left {STALLS.rate('pdproxy_stall_seconds_total')}", "{{cause}}")],
                     "percentunit", stack=True, max_=1), w=8)
    L.add(timeseries("Stalls from KV arrivals per decode instance [stall]",
                     ITL_DEFINITIONS["stall"] + " Stalls per second on each decode instance put down to another "
                     "request's KV arriving there. The instance's address is `server_address`.",
                     [prom('sum by (server_address) (rate(pdproxy_instance_stalls_total{cause="kv_arrival"}'
                           '[$__rate_interval]))', "{{server_address}}", exemplar=True)], "short"), w=8)
    L.add(trace_table("Victims → culprits: stalled requests and the requests behind their stalls [stall]",
                      ITL_DEFINITIONS["stall"] + " pd.decode spans with attributed stall time, by cause (seconds); "
                      "open a trace: its pd.decode's span links lead to the culprits' pd.decode (KV arrival) or "
                      "pd.prefill (prefill), and each pd.stall event names them (pd.stall.culprit_ids).",
                      traceql('{ name = "pd.decode" && span.pd.deployment =~ "$deployment" && '
                              '(span.pd.stall.time.kv_arrival > 0 || span.pd.stall.time.prefill > 0 || '
                              'span.pd.stall.time.migration > 0) } | select(span.pd.stall.time.kv_arrival, '
                              'span.pd.stall.time.prefill, span.pd.stall.time.migration, span.server.address)',
                              table="spans")), w=24, h=9)

    L.row("KV transfer (prefill response → first decode token)")
    L.add(timeseries("pd.kv_transfer p50 / p90 / p99 (upper bound)",
                     "Duration of the pd.kv_transfer span: proxy hand-off + HTTP + the decode's intake before "
                     "its engine queue + decode queue and KV pull + one decode step. "
                     "An upper bound on the transfer, never the transfer alone.",
                     quantiles(REQ, "pdproxy_stage_duration_seconds", "kv_transfer", 'stage="kv_transfer"')), w=8)
    L.add(timeseries("Decode: intake, KV wait and compute p50 / p99 (vLLM's spans)",
                     "What pd.kv_transfer is made of, from vLLM's own llm_request spans on the decode instances "
                     "(vLLM with --otlp-traces-endpoint, service.name containing 'decode'; derived by the "
                     "collector): KV wait = the decode's time_in_queue (waiting for the remote KV, NIXL pull "
                     "included); compute = its first step once the KV is there (time_in_model_prefill). "
                     "decode intake = the decode's time_to_first_token − time_in_queue − time_in_model_prefill: "
                     "on the decode, from its API server's arrival to its engine core queueing the request (plus "
                     "the first token's way back to its API server), not the proxy's. pd.kv_transfer minus the "
                     "three is HTTP and the proxy's own hand-off (its own panel). All instances and runs.",
                     [prom(VLLM.quantile(0.5, "pdproxy_trace_decode_kv_wait_seconds"), "KV wait p50"),
                      prom(VLLM.quantile(0.99, "pdproxy_trace_decode_kv_wait_seconds"), "KV wait p99", exemplar=True),
                      prom(VLLM.quantile(0.5, "pdproxy_trace_decode_first_step_seconds"), "first step p50"),
                      prom(VLLM.quantile(0.99, "pdproxy_trace_decode_first_step_seconds"), "first step p99"),
                      prom(VLLM.quantile(0.5, "pdproxy_trace_decode_intake_seconds"), "decode intake p50"),
                      prom(VLLM.quantile(0.99, "pdproxy_trace_decode_intake_seconds"), "decode intake p99")]), w=8)
    L.add(timeseries("Proxy's own hand-off gap p50 / p99",
                     "Prefill response read → decode request sent: the proxy's share of the hand-off.",
                     quantiles(REQ, "pdproxy_handoff_gap_seconds", "hand-off", qs=(0.5, 0.99))), w=8)

    L.row("Throughput and per-instance load")
    L.add(timeseries("Tokens/s by type", "Input and output tokens from the instances' usage reports.",
                     [prom(REQ.rate("pdproxy_tokens_total", by="type"), "{{type}}")], "short"), w=8)
    L.add(timeseries("E2E p50 / p99", "Received → end of stream.",
                     quantiles(REQ, "pdproxy_e2e_seconds", "E2E", qs=(0.5, 0.99))), w=8)
    L.add(timeseries("Proxy in flight and waiting",
                     "Requests inside the proxy, and requests waiting for admission (--max-inflight).",
                     [prom("sum(pdproxy_inflight_requests)", "in flight"),
                      prom("sum(pdproxy_queue_depth)", "waiting")], "short"), w=8)
    L.add(timeseries("In flight per instance",
                     "Requests in flight on each prefill and decode instance (per-instance load). The "
                     "instance's address is `server_address` (`instance` is the pdproxy replica Prometheus scraped).",
                     [prom("sum by (role, server_address) (pdproxy_instance_inflight)", "{{role}} {{server_address}}")],
                     "short"), w=12)
    L.add(timeseries("Instance health",
                     "1 = healthy, 0 = ejected after consecutive failures until a health check passes.",
                     [prom("min by (role, server_address) (pdproxy_instance_healthy)", "{{role}} {{server_address}}")],
                     "short", max_=1), w=6)
    L.add(timeseries("Spans dropped/s (telemetry health)",
                     "Spans lost on the way to the collector: export queue full, or export failed. "
                     "Derived metrics and traces undercount while this is above zero.",
                     [prom("sum by (reason) (rate(pdproxy_spans_dropped_total[$__rate_interval]))", "{{reason}}")],
                     "short"), w=6)

    L.row("Attempts per instance (where requests were sent, not where they ended)")
    attempts_note = ("Counted where each attempt was sent: an instance that dies while retries or migration save all "
                     "its requests ends none of them, so it shows here and not in the request counts. The instance's "
                     "address is `server_address`; every configured instance has a series from the proxy's start.")
    L.add(timeseries("Attempts/s per instance",
                     "Attempts sent to each prefill and decode (a retried or migrated request counts once per "
                     "attempt). " + attempts_note,
                     [prom("sum by (role, server_address) (rate(pdproxy_instance_attempts_total[$__rate_interval]))",
                           "{{role}} {{server_address}}")], "short"), w=6)
    L.add(timeseries("Failed attempts/s per instance, by reason",
                     "Failed attempts on each instance by the proxy's error type, also those a retry or migration "
                     "saved. " + attempts_note,
                     [prom("sum by (role, server_address, reason) "
                           "(rate(pdproxy_instance_attempt_failures_total[$__rate_interval]))",
                           "{{role}} {{server_address}} {{reason}}")], "short", stack=True), w=6)
    L.add(timeseries("Share of attempts that failed, per instance",
                     "Failed attempts / attempts sent, per instance: near 1 for a dead instance even while every "
                     "request succeeds. " + attempts_note,
                     [prom("sum by (role, server_address) (rate(pdproxy_instance_attempt_failures_total"
                           "[$__rate_interval])) / sum by (role, server_address) "
                           "(rate(pdproxy_instance_attempts_total[$__rate_interval]))", "{{role}} {{server_address}}")],
                     "percentunit", max_=1), w=6)
    L.add(timeseries("Requests moved away and hand-offs abandoned/s per instance",
                     "Requests moved to another instance of the role after an attempt on this one failed, by stage; "
                     "and failed attempts on a decode that gave up the request's KV hand-off (the prefill holds those "
                     "blocks until VLLM_NIXL_ABORT_REQUEST_TIMEOUT). " + attempts_note,
                     [prom("sum by (role, server_address, stage) "
                           "(rate(pdproxy_instance_moved_away_total[$__rate_interval]))",
                           "{{role}} {{server_address}} moved ({{stage}})"),
                      prom("sum by (server_address) "
                           "(rate(pdproxy_instance_abandoned_handoffs_total[$__rate_interval]))",
                           "decode {{server_address}} hand-offs abandoned")], "short"), w=6)

    L.row("Routing by KV events (precise_prefix, selective disaggregation)")
    L.add(timeseries("Share of routing decisions on the approximate index",
                     "precise_prefix decisions that fell back to the approximate prefix index (KV events not "
                     "flowing, no block stored yet, no token ids, /tokenize failed ...), per leg: requests are "
                     "still served, routed on a guess. PdproxyRoutingDegraded fires above 20% for 10 minutes.",
                     [prom('sum by (role) (rate(pdproxy_route_decisions_total{policy="precise_prefix", '
                           'reason="approximate"}[$__rate_interval])) / sum by (role) '
                           '(rate(pdproxy_route_decisions_total{policy="precise_prefix"}[$__rate_interval]))',
                           "{{role}}")], "percentunit", max_=1), w=8)
    L.add(timeseries("Fallbacks/s by reason and instance",
                     "Why decisions fell back, counted per candidate instance whose state caused it (or the "
                     "chosen one when the request did): events_off, events_not_flowing, no_block_stored, "
                     "no_token_ids, tokenize_failed, block_size_mismatch (docs/reference/telemetry.md).",
                     [prom("sum by (role, server_address, reason) (rate(pdproxy_route_fallbacks_total"
                           "[$__rate_interval]))", "{{role}} {{server_address}} {{reason}}")], "short", stack=True), w=8)
    L.add(timeseries("KV events flowing per instance",
                     "1 while the proxy's index of an instance's KV cache is in sync and used for routing (with "
                     "--workers: only when in sync on every worker). PdproxyKVEventsNotFlowing fires after 5 "
                     "minutes at 0 while routing uses it.",
                     [prom("min by (server_address) (pdproxy_kv_events_flowing)", "{{server_address}}")],
                     "short", max_=1), w=8)

    L.row("Primary vs shadow (same requests)")
    L.add(timeseries("TTFT p50 / p99 by deployment",
                     "Primary (P/D) and shadow (baseline) on identical traffic.",
                     [prom(BOTH.quantile(q, "pdproxy_ttft_seconds", by="deployment"), f"{{{{deployment}}}} p{round(q * 100)}",
                           exemplar=q == 0.99) for q in (0.5, 0.99)]), w=8)
    L.add(timeseries("Tail ITL p50 / p99 by deployment [per-request max gap]",
                     ITL_DEFINITIONS["tail_max"],
                     [prom(BOTH.quantile(q, "pdproxy_request_itl_max_seconds", by="deployment"),
                           f"{{{{deployment}}}} p{round(q * 100)}", exemplar=q == 0.99) for q in (0.5, 0.99)]), w=8)
    L.add(timeseries("Pooled ITL p99 and TPOT p50 by deployment [pooled ITL | TPOT]",
                     ITL_DEFINITIONS["pooled"] + " " + ITL_DEFINITIONS["tpot"],
                     [prom(BOTH.quantile(0.99, "pdproxy_itl_seconds", by="deployment"), "{{deployment}} pooled ITL p99", exemplar=True),
                      prom(BOTH.quantile(0.5, "pdproxy_tpot_seconds", by="deployment"), "{{deployment}} TPOT p50")]), w=8)
    L.add(timeseries("Error ratio by deployment",
                     "Failed requests / all requests, per deployment.",
                     [prom(share(BOTH.rate('pdproxy_requests_total', FAILED, by='deployment'),
                                 BOTH.rate('pdproxy_requests_total', by='deployment')), "{{deployment}}")],
                     "percentunit"), w=8)
    L.add(timeseries("Requests/s by deployment", "Requests that ended, per deployment.",
                     [prom(BOTH.rate("pdproxy_requests_total", by="deployment"), "{{deployment}}")], "reqps"), w=8)
    L.add(timeseries("Shadow mirroring outcomes",
                     "Copies sent to the shadow, dropped because it was busy, failed, or not sampled.",
                     [prom("sum by (outcome) (rate(pdproxy_shadow_requests_total[$__rate_interval]))", "{{outcome}}")],
                     "reqps", stack=True), w=8)

    L.row("Slowest requests (Tempo: tail-sampled traces)")
    L.add(trace_table("Slowest requests by TTFT (TTFT > $ttft_slo s) [per-request max/p99 gap columns]",
                      "Root spans over the TTFT SLO with their stage breakdown; click a trace id to open the trace. "
                      "Only traces kept by the collector's tail sampling (errors, slow TTFT, stalls, baseline share). "
                      "Columns pd.itl.max / pd.itl.p99: " + ITL_DEFINITIONS["tail_max"],
                      traceql(f"{{ {ROOT_FILTER} && span.gen_ai.response.time_to_first_chunk > $ttft_slo }} "
                              f"| select({TRACE_COLUMNS})")), w=12, h=10)
    L.add(trace_table("Requests with the worst tail ITL (max gap > $stall s) [per-request max gap]",
                      ITL_DEFINITIONS["tail_max"] + " Click a trace id to open the trace.",
                      traceql(f"{{ {ROOT_FILTER} && span.pd.itl.max > $stall }} | select({TRACE_COLUMNS})")), w=12, h=10)

    return dashboard(OVERVIEW_UID, "pdproxy — P/D overview",
                     "Measured by the proxy on every request (GET /metrics), with exemplars linking to traces.",
                     L.panels, proxy_variables(), [link_to(TRACES_UID, "Computed from traces")])


# ---------------------------------------------------------------------------------------------
# Dashboard 2: the same quantities computed from the spans (collector connectors, Tempo).


def trace_variables() -> list[dict]:
    return [
        query_variable("run", "Run label", "label_values(pdproxy_trace_requests_total, pd_run)"),
        query_variable("model", "Model", 'label_values(pdproxy_trace_requests_total{pd_run=~"$run"}, gen_ai_request_model)'),
        query_variable("deployment", "Deployment", 'label_values(pdproxy_trace_requests_total{pd_run=~"$run"}, pd_deployment)'),
        custom_variable("stall", "Stall above (s)", STALL_CHOICES, "0.1",
                        "A gap longer than this is a stall. Exact bucket bounds of the gap histograms only."),
    ]


def from_traces() -> dict:
    L = Layout()
    L.add(alert_list("Firing alerts", "pdproxy alerts firing or pending in Prometheus (deploy/prometheus/rules/), "
                                      "PdproxySpansDropped and PdproxyTraceMetricsIncomplete among them: while those "
                                      "fire, this dashboard undercounts."), w=24, h=5)

    L.row("Stage durations from span_metrics (every span, before sampling)")
    L.add(timeseries("Stage p50 / p99 from spans",
                     "Durations of the pd.* stage spans (span_metrics connector). Exemplars link to traces.",
                     [prom(SPANS.quantile(q, "traces_span_metrics_duration_seconds", 'span_name=~"pd\\\\..*"', by="span_name"),
                           f"{{{{span_name}}}} p{round(q * 100)}", exemplar=q == 0.99) for q in (0.5, 0.99)]), w=12)
    L.add(timeseries("Stage spans/s by status",
                     "Calls per stage span and status code (STATUS_CODE_ERROR = the stage that failed).",
                     [prom(SPANS.rate("traces_span_metrics_calls_total", 'span_name=~"pd\\\\..*"', by="span_name, status_code"),
                           "{{span_name}} {{status_code}}")], "reqps"), w=12)

    L.row("Attribute histograms from signal_to_metrics, next to the proxy's own")
    L.add(timeseries("TTFT p50 / p99: traces vs proxy",
                     "Same buckets on both sides; the lines should overlap when head sampling is 100%.",
                     [*[prom(TRACE.quantile(q, "pdproxy_trace_ttft_seconds"), f"traces p{round(q * 100)}") for q in (0.5, 0.99)],
                      *[prom(REQ.quantile(q, "pdproxy_ttft_seconds"), f"proxy p{round(q * 100)}") for q in (0.5, 0.99)]]), w=12)
    L.add(timeseries("Tail ITL p50 / p99: traces vs proxy [per-request max gap]",
                     ITL_DEFINITIONS["tail_max"],
                     [*[prom(TRACE.quantile(q, "pdproxy_trace_request_itl_max_seconds"), f"traces p{round(q * 100)}")
                        for q in (0.5, 0.99)],
                      *[prom(REQ.quantile(q, "pdproxy_request_itl_max_seconds"), f"proxy p{round(q * 100)}") for q in (0.5, 0.99)]]),
          w=12)
    L.add(timeseries("Tail ITL from traces [per-request p99 gap]",
                     ITL_DEFINITIONS["tail_p99"],
                     quantiles(TRACE, "pdproxy_trace_request_itl_p99_seconds", "p99 gap", exemplar_on=None)), w=8)
    L.add(timeseries("KV transfer estimate and hand-off gap from traces",
                     "pd.kv_transfer.estimated = span duration minus one median ITL (an estimate, not a measurement); "
                     "pd.handoff.gap = the proxy's own share.",
                     [prom(RUN.quantile(0.5, "pdproxy_trace_kv_transfer_estimated_seconds"), "estimate p50"),
                      prom(RUN.quantile(0.99, "pdproxy_trace_kv_transfer_estimated_seconds"), "estimate p99"),
                      prom(RUN.quantile(0.99, "pdproxy_trace_handoff_gap_seconds"), "hand-off p99")]), w=8)
    L.add(timeseries("Instances' queue time p50 / p99 (vLLM's spans)",
                     "vLLM's time_in_queue from its llm_request spans, per instance (service.name): on a P/D "
                     "decode it holds the wait for the remote KV.",
                     [prom(VLLM.quantile(q, "pdproxy_trace_instance_queue_seconds", by="service_name"),
                           f"{{{{service_name}}}} p{round(q * 100)}") for q in (0.5, 0.99)]), w=8)
    L.add(timeseries("Share of requests with a stall: traces vs proxy",
                     ITL_DEFINITIONS["stall"],
                     [prom(f'{TRACE.rate("pdproxy_trace_requests_stalled_total")} / {TRACE.rate("pdproxy_trace_requests_total")}',
                           "traces"),
                      prom(f'{REQ.rate("pdproxy_requests_with_stall_total")} / {REQ.rate("pdproxy_request_itl_max_seconds_count")}',
                           "proxy")], "percentunit", max_=1), w=8)

    L.add(timeseries("Stall time by cause: traces vs proxy (live attribution) [stall]",
                     ITL_DEFINITIONS["stall"] + " The collector sums pd.decode's pd.stall.time.<cause> attributes; "
                     "the proxy's pdproxy_stall_seconds_total is the same attribution counted on /metrics.",
                     [prom(TRACE.rate("pdproxy_trace_stall_time_seconds_total", by="pd_stall_cause"),
                           "traces {{pd_stall_cause}}"),
                      prom(STALLS.rate("pdproxy_stall_seconds_total", by="cause"), "proxy {{cause}}")]), w=12)
    L.add(timeseries("Stalls by cause and decode instance from traces [stall]",
                     ITL_DEFINITIONS["stall"] + " The collector sums pd.decode's pd.stall.count.<cause> by cause "
                     "and by the instance that streamed (server.address: the decode in P/D).",
                     [prom(TRACE.rate("pdproxy_trace_stalls_total", by="pd_stall_cause, server_address"),
                           "{{pd_stall_cause}} {{server_address}}")], "short"), w=12)

    L.row("TraceQL metrics (Tempo 3: any numeric span attribute)")
    L.add(timeseries("Tail ITL quantiles from stored traces [per-request max gap]",
                     ITL_DEFINITIONS["tail_max"] + " Computed by Tempo over the tail-sampled traces only: biased towards "
                     "slow and failed requests, unlike the panels above.",
                     [traceql_metrics(f"{{ {ROOT_FILTER} && span.pd.itl.max != nil }} "
                                      "| quantile_over_time(span.pd.itl.max, 0.5, 0.9, 0.99)")]), w=12)
    L.add(timeseries("Failed stages in stored traces",
                     "Rate of stored root spans by failed stage.",
                     [traceql_metrics(f"{{ {ROOT_FILTER} && span.pd.failed_stage != nil }} | rate() by (span.pd.failed_stage)")],
                     "reqps"), w=12)

    return dashboard(TRACES_UID, "pdproxy — computed from traces",
                     "The proxy's numbers recomputed from its spans by the collector (span_metrics, signal_to_metrics) "
                     "and by Tempo (TraceQL metrics). Needs the collector in front of Prometheus.",
                     L.panels, trace_variables(), [link_to(OVERVIEW_UID, "P/D overview")])


DASHBOARDS = {"pdproxy-overview.json": overview, "pdproxy-traces.json": from_traces}


def render(build) -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed dashboards differ from the generated ones")
    args = parser.parse_args(argv)

    stale = []
    for name, build in DASHBOARDS.items():
        path, text = OUT / name, render(build)
        if args.check:
            current = path.read_text() if path.exists() else ""
            if current != text:
                stale.append(name)
                sys.stdout.writelines(difflib.unified_diff(
                    current.splitlines(keepends=True), text.splitlines(keepends=True), f"committed/{name}", f"generated/{name}", n=1))
        else:
            OUT.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(HERE.parent)}")
    if stale:
        print(f"\nstale: {', '.join(stale)}; run: python grafana/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
