"""The report as one self-contained HTML page: tables in HTML, plots drawn as SVG by inline JS.

No CDN, no network: the report data is embedded as JSON and a small script (below) draws the
TTFT and ITL CDFs, the per-request tail ITL (CDF and over time) and the stage breakdown. Times
that span decades are on log axes (CDFs' x, the tail-over-time scatter's y): one 9 s outlier must
not squeeze every other point against the axis. When
every plot is drawn the script sets `data-rendered` on <body> to the number of plots (a test
reads it back from a real browser); an error is shown on the page instead of failing silently.
"""

from __future__ import annotations

import html
import json
from typing import Any

from pdproxy.bench.table import (INSTANCE_NOTE, condition_rows, instance_groups, metric_rows, ms, pairing_text,
                                 results_title, split_text, stalls_text)

CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#1a1a1a;max-width:1400px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:6px 0} th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;
vertical-align:top} td.num{text-align:right;font-variant-numeric:tabular-nums} th{background:#f4f4f4}
.verdict{padding:10px 14px;border-radius:6px;margin:12px 0;font-size:15px}
.adopt{background:#e6f6e6;border:1px solid #5a5} .reject{background:#fbe9e9;border:1px solid #c55} .undecided{background:#fdf6e3;border:1px solid #b90}
.flag{background:#fff6dc;border:1px solid #e0b000;padding:6px 10px;margin:4px 0;border-radius:4px}
.pass{color:#1a7f1a;font-weight:600} .fail{color:#b00;font-weight:600} .dim{color:#777}
.plots{display:flex;flex-wrap:wrap;gap:18px} .plot{border:1px solid #e3e3e3;border-radius:6px;padding:6px}
.plot h3{font-size:14px;margin:2px 4px 4px} #js-error{color:#b00;font-weight:600}
code{background:#f4f4f4;padding:0 3px}
"""

# Hand-written plotting: lines (CDFs), points (scatter) and stacked bars, as SVG elements.
JS = r"""
(function(){
const data = JSON.parse(document.getElementById('report-data').textContent);
const NS = 'http://www.w3.org/2000/svg';
const COLORS = ['#1f77b4','#d62728','#2ca02c','#ff7f0e','#9467bd','#8c564b','#e377c2','#17becf'];
function el(tag, attrs, parent){ const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]); if (parent) parent.appendChild(e); return e; }
function ticks(lo, hi, n){ const span = hi - lo || 1; const step0 = span / n;
  const mag = Math.pow(10, Math.floor(Math.log10(step0))); const err = step0 / mag;
  const step = (err >= 5 ? 10 : err >= 2 ? 5 : err >= 1 ? 2 : 1) * mag; const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-12; v += step) out.push(+v.toPrecision(12)); return out; }
// An axis from lo to hi onto pixels a..b: linear, or log10 (times spanning decades: one 9 s gap must not
// squeeze every other point against the axis); values at or below 0 sit at a log axis' start.
function axis(lo, hi, log, a, b){
  if (log) { const l0 = Math.floor(Math.log10(lo)), l1 = Math.max(Math.ceil(Math.log10(hi)), l0 + 1);
    const s = v => a + (Math.log10(Math.max(v, Math.pow(10, l0))) - l0) / (l1 - l0) * (b - a); const t = [];
    for (let k = l0; k <= l1; k++) for (const m of [1, 2, 5]) { const v = m * Math.pow(10, k);
      if (v <= Math.pow(10, l1) * 1.0001) t.push(+v.toPrecision(6)); }
    return {s, ticks: t}; }
  return {s: v => a + (hi ? v / hi : 0) * (b - a), ticks: ticks(0, hi, 6)};
}
function frame(container, title, xlabel, ylabel, xr, yr, W, H, noY){
  const box = document.createElement('div'); box.className = 'plot';
  const h = document.createElement('h3'); h.textContent = title; box.appendChild(h);
  const svg = el('svg', {width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: 'img'}); box.appendChild(svg);
  container.appendChild(box);
  const m = {l: 56, r: 12, t: 8, b: noY ? 56 : 40}; const pw = W - m.l - m.r, ph = H - m.t - m.b;
  const xa = axis(xr.lo, xr.hi, xr.log, m.l, m.l + pw), ya = axis(yr.lo, yr.hi, yr.log, m.t + ph, m.t);
  const sx = xa.s, sy = ya.s;
  el('rect', {x: m.l, y: m.t, width: pw, height: ph, fill: '#fff', stroke: '#bbb'}, svg);
  for (const t of xa.ticks) { el('line', {x1: sx(t), x2: sx(t), y1: m.t, y2: m.t + ph, stroke: '#eee'}, svg);
    const tx = el('text', {x: sx(t), y: m.t + ph + 14, 'font-size': 10, 'text-anchor': 'middle'}, svg); tx.textContent = t; }
  if (!noY) for (const t of ya.ticks) { el('line', {x1: m.l, x2: m.l + pw, y1: sy(t), y2: sy(t), stroke: '#eee'}, svg);
    const ty = el('text', {x: m.l - 4, y: sy(t) + 3, 'font-size': 10, 'text-anchor': 'end'}, svg); ty.textContent = t; }
  const xl = el('text', {x: m.l + pw / 2, y: H - 6, 'font-size': 11, 'text-anchor': 'middle'}, svg); xl.textContent = xlabel;
  const yl = el('text', {x: 12, y: m.t + ph / 2, 'font-size': 11, 'text-anchor': 'middle',
    transform: `rotate(-90 12 ${m.t + ph / 2})`}, svg); yl.textContent = ylabel;
  if (xr.log) svg.setAttribute('data-log-x', '1'); if (yr.log) svg.setAttribute('data-log-y', '1');
  return {svg, sx, sy, m, pw, ph, box};
}
function positive(vals){ const p = vals.filter(v => v > 0); return p.length ? Math.min(...p) : 1; }
function legend(f, names){ names.forEach((n, i) => {
  const y = f.m.t + 14 + 14 * i, x = f.m.l + f.pw - 150;
  el('rect', {x: x, y: y - 8, width: 10, height: 10, fill: COLORS[i % COLORS.length]}, f.svg);
  const t = el('text', {x: x + 14, y: y + 1, 'font-size': 11}, f.svg); t.textContent = n; }); }
function cdf(container, key, title, xlabel){
  const runs = data.runs; let xmax = 0; const xs = [];
  runs.forEach(r => (r.plots[key] || []).forEach(p => { xmax = Math.max(xmax, p[0] * 1000); xs.push(p[0] * 1000); }));
  const f = frame(container, title, xlabel + ', log scale', 'fraction of samples',
                  {lo: positive(xs), hi: xmax || 1, log: true}, {lo: 0, hi: 1}, 560, 300);
  f.box.dataset.plot = key;
  if (!xmax) { const t = el('text', {x: f.m.l + 10, y: f.m.t + 20, 'font-size': 12, 'data-empty': '1'}, f.svg);
    t.textContent = key === 'itl' && data.definitions.itl_pooled ? data.definitions.itl_pooled : 'no data'; }
  runs.forEach((r, i) => { const pts = r.plots[key] || []; if (!pts.length) return;
    let d = `M${f.sx(pts[0][0] * 1000)},${f.sy(0)}`;
    for (const p of pts) d += ` L${f.sx(p[0] * 1000).toFixed(1)},${f.sy(p[1]).toFixed(1)}`;
    el('path', {d: d, fill: 'none', stroke: COLORS[i % COLORS.length], 'stroke-width': 1.8, 'data-run': r.label}, f.svg); });
  legend(f, runs.map(r => r.label));
}
function scatter(container){
  const runs = data.runs; let xmax = 0, ymax = 0; const ys = [];
  runs.forEach(r => (r.plots.tail_itl_by_start || []).forEach(p => { xmax = Math.max(xmax, p[0]); ymax = Math.max(ymax, p[1] * 1000);
    ys.push(p[1] * 1000); }));
  const f = frame(container, 'Tail ITL per request (max gap) over the run', 'request start (s)', 'max gap (ms), log scale',
                  {lo: 0, hi: xmax * 1.02 || 1}, {lo: positive(ys), hi: ymax || 1, log: true}, 560, 300);
  f.box.dataset.plot = 'tail_itl_by_start';
  runs.forEach((r, i) => { const g = el('g', {'data-run': r.label, fill: COLORS[i % COLORS.length], 'fill-opacity': 0.6}, f.svg);
    for (const p of (r.plots.tail_itl_by_start || [])) el('circle', {cx: f.sx(p[0]).toFixed(1), cy: f.sy(p[1] * 1000).toFixed(1), r: 2.2}, g); });
  legend(f, runs.map(r => r.label));
}
function stages(container){
  const names = ['queue', 'prefill', 'kv_transfer', 'decode']; const runs = data.runs; let xmax = 0;
  const vals = runs.map(r => names.map(s => (r.stages && r.stages[s] && r.stages[s].count) ? r.stages[s].mean * 1000 : 0));
  vals.forEach(v => { xmax = Math.max(xmax, v.reduce((a, b) => a + b, 0)); });
  const H = 70 + 34 * runs.length;
  const f = frame(container, 'Stage breakdown (mean per request, from the proxy traces)', 'ms', '',
                  {lo: 0, hi: xmax * 1.05 || 1}, {lo: 0, hi: 1}, 560, H, true);
  f.box.dataset.plot = 'stages';
  const bh = f.ph / runs.length * 0.6;
  runs.forEach((r, i) => { let x0 = 0; const y = f.m.t + (i + 0.2) * f.ph / runs.length;
    const lab = el('text', {x: f.m.l + 4, y: y - 2, 'font-size': 10}, f.svg); lab.textContent = r.label + (r.stages ? '' : ' (no traces)');
    vals[i].forEach((v, j) => { if (v <= 0) return;
      const rect = el('rect', {x: f.sx(x0), y: y, width: Math.max(0.5, f.sx(x0 + v) - f.sx(x0)), height: bh,
        fill: COLORS[(j + 4) % COLORS.length], 'data-stage': names[j]}, f.svg);
      const tt = el('title', {}, rect); tt.textContent = `${names[j]}: ${v.toFixed(1)} ms`; x0 += v; }); });
  names.forEach((n, j) => { const x = f.m.l + 8 + 110 * j, y = f.m.t + f.ph + 30;
    el('rect', {x: x, y: y - 8, width: 10, height: 10, fill: COLORS[(j + 4) % COLORS.length]}, f.svg);
    const t = el('text', {x: x + 14, y: y + 1, 'font-size': 11}, f.svg); t.textContent = n; });
}
try {
  const c = document.getElementById('plots');
  cdf(c, 'ttft', 'TTFT, CDF over requests', 'TTFT (ms)');
  cdf(c, 'itl', 'ITL (pooled, per ' + data.definitions.itl_unit + '), CDF over gaps', 'gap (ms)');
  cdf(c, 'tail_itl', 'Tail ITL: per-request max gap, CDF over requests', 'max gap of a request (ms)');
  scatter(c);
  stages(c);
  document.body.setAttribute('data-rendered', String(c.querySelectorAll('.plot svg').length));
} catch (e) {
  document.getElementById('js-error').textContent = 'plot error: ' + e;
  document.body.setAttribute('data-rendered', 'error');
}
})();
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _table(head: list[str], rows: list[list[str]], num_from: int = 1) -> str:
    out = ["<table><thead><tr>", *(f"<th>{_e(h)}</th>" for h in head), "</tr></thead><tbody>"]
    for r in rows:
        out.append("<tr>" + "".join(
            f"<td class=\"{'num' if i >= num_from else ''}\">{_e(c)}</td>" for i, c in enumerate(r)) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _verdict(report: dict[str, Any]) -> str:
    """Each verdict (same resources first, then capacity); the first keeps the ids the page always had."""
    verdicts = report.get("verdicts") or ([report["verdict"]] if report.get("verdict") else [])
    return "".join(_one_verdict(v, "" if i == 0 else f"-{i + 1}") for i, v in enumerate(verdicts))


def _one_verdict(v: dict[str, Any], suffix: str) -> str:
    cls = "adopt" if v["decision"] in ("adopt", "pass") else "reject" if v["decision"] in ("don't adopt", "fail") \
        else "undecided"
    rows = []
    for c in v["criteria"]:
        mark = {True: "<span class=pass>pass</span>", False: "<span class=fail>FAIL</span>",
                None: "<span class=dim>—</span>"}[c["passed"]]
        name = c["criterion"] + (f" vs {c['baseline']}" if c.get("baseline") else "")
        rows.append(f"<tr><td>{mark}</td><td>{_e(name)}</td><td>{_e(c['detail'])}</td></tr>")
    notes = "".join(f"<div class=flag>{_e(n)}</div>" for n in v.get("notes") or [])
    kind = f" · <b>{_e(v['resources_text'])}</b>" if v.get("resources_text") else ""
    return (f"<div class='verdict {cls}' id=verdict{suffix}><b>Verdict: {_e(v['decision'].upper())}</b> "
            f"({_e(v['candidate'])} vs {_e(', '.join(v['baselines']))}){kind}<br>decided by: {_e(v['reason'])}</div>"
            f"<table id=criteria{suffix}><thead><tr><th></th><th>criterion</th><th>detail</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>{notes}")


def _instances(report: dict[str, Any]) -> str:
    """Per run that spread over more than one instance, one table per role with that role's own columns
    (bench/instances.py, bench/table.py)."""
    out = []
    for e in report["runs"]:
        if len(e.get("instances") or []) < 2:
            continue
        out.append(f"<h2>Per instance, {_e(e['label'])} (from the traces; ms)</h2>")
        for role, columns, rows in instance_groups(e):
            out.append(_table(columns, rows, num_from=1).replace(
                "<table>", f"<table class=instances data-run='{_e(e['label'])}' data-role='{_e(role)}'>", 1))
        out.append(f"<div class=dim>{_e(INSTANCE_NOTE)}</div>")
    return "".join(out)


def _drill(report: dict[str, Any]) -> str:
    rows = []
    for e in report["runs"]:
        for by, title in (("ttft", "TTFT"), ("tail_itl", "tail ITL")):
            for r in e["slowest"][by]:
                st = r.get("stages") or {}
                rows.append([e["label"], title, r["request_id"], r["trace_id"] or "—", str(r["class"]),
                             ms(r["ttft"]), ms(r["itl_max"]),
                             *[ms(st.get(s)) if s in st else "—" for s in ("queue", "prefill", "kv_transfer",
                                                                           "decode")],
                             split_text(r.get("split") or {}) or "—",
                             stalls_text(r.get("stalls") or [], r.get("stall_count", 0)) or "—"])
    failed = []
    for e in report["runs"]:
        for r in e["failed"]:
            failed.append([e["label"], r["request_id"], r["trace_id"] or "—", str(r.get("status")),
                           str(r.get("error")), str(r.get("failed_stage") or ""), str(r.get("error_detail") or "")])
    out = "<h2>Slowest requests (drill-down by trace id)</h2>" + _table(
        ["run", "by", "request id", "trace id", "class", "TTFT ms", "max gap ms", "queue", "prefill", "kv_transfer",
         "decode", "split by vLLM's spans (ms)", "stalls: cause (with)"], rows, num_from=5)
    if failed:
        out += "<h2>Failed requests</h2>" + _table(
            ["run", "request id", "trace id", "status", "reason", "failed stage", "detail"], failed, num_from=99)
    return out


def render(report: dict[str, Any]) -> str:
    runs = report["runs"]
    labels = [e["label"] for e in runs]
    d = report["definitions"]
    comp = report["comparison"]
    flags = "".join(f"<div class=flag>{_e(f)}</div>" for f in comp.get("flags") or [])
    notes = "".join(f"<div class=flag>{_e(e['label'])}: {_e(n)}</div>" for e in runs
                    for n in [*(e.get("instance_flags") or []), *e["condition_notes"], *(e.get("length_flags") or []),
                              *((e.get("prompts") or {}).get("notes") or [])])
    defs = "".join(f"<li><b>{_e(k)}</b>: {_e(v)}</li>" for k, v in d.items() if v is not None)
    payload = json.dumps({"runs": [{"label": e["label"], "plots": e["plots"], "stages": e["stages"]} for e in runs],
                          "definitions": d}, separators=(",", ":")).replace("</", "<\\/")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>pdproxy report: {_e(' vs '.join(labels))}</title>
<style>{CSS}</style></head>
<body>
<h1>pdproxy report: {_e(' vs '.join(labels))}</h1>
<div class=dim>generated {_e(report['generated_at'])} by pdproxy {_e(report['pdproxy_version'])}</div>
{_verdict(report)}
<h2>Fixed conditions</h2>
{_table(['condition', *labels], [[n, *c] for n, c in condition_rows(report)], num_from=99)}
{('<div><b>Comparison:</b> ' + _e(comp['resources']) + '</div>') if comp.get('resources') else ''}{flags}{notes}
{('<div id=pairing><b>' + _e(pairing_text(report)) + '</b></div>') if report.get('pairing') else ''}
<h2>{_e(results_title(report))}</h2>
<table id=metrics><thead><tr><th>metric</th>{''.join(f'<th>{_e(x)}</th>' for x in labels)}</tr></thead><tbody>
{''.join('<tr><td>' + _e(n) + '</td>' + ''.join(f'<td class=num>{_e(c)}</td>' for c in cells) + '</tr>'
         for n, cells in metric_rows(report))}
</tbody></table>
{_instances(report)}
<h2>Plots</h2><div id=js-error></div><div class=plots id=plots></div>
{_drill(report)}
<h2>Definitions</h2><ul>{defs}</ul>
<script type="application/json" id="report-data">{payload}</script>
<script>{JS}</script>
</body></html>
"""
