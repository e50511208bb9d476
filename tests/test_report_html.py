"""The HTML report in a real browser: headless Chromium runs the page's script and we read the DOM."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

from test_report_verdict import CHUNKED, PD, SINGLE, write_run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
FIX = Path(__file__).parent / "fixtures" / "bench" / "aiperf"

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium not installed (.ci/run installs it)")


def chromium(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           f"--user-data-dir={tmp / 'profile'}", "--virtual-time-budget=3000", *args],
                          capture_output=True, text=True, timeout=90)


class Dom(HTMLParser):
    """Just enough of the DOM: every element with its attributes and its ancestors' plot name."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[tuple[str, dict]] = []
        self.elements: list[tuple[str, dict, str | None]] = []
        self.body: dict = {}
        self.text: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag == "body":
            self.body = a
        plot = next((x.get("data-plot") for _, x in reversed(self.stack) if x.get("data-plot")), a.get("data-plot"))
        self.elements.append((tag, a, plot))
        if tag not in ("circle", "path", "rect", "line", "meta", "br", "input", "img"):
            self.stack.append((tag, a))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                del self.stack[i:]
                break

    def handle_data(self, data: str) -> None:
        for _, a in self.stack:  # text of every element with an id, descendants included
            if a.get("id"):
                self.text[a["id"]] = self.text.get(a["id"], "") + data


def png_distinct_bytes(path: Path) -> int:
    """Distinct byte values of the decompressed image data (a blank page has a handful)."""
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    while pos < len(raw):
        n, kind = struct.unpack(">I4s", raw[pos:pos + 8])
        if kind == b"IDAT":
            idat += raw[pos + 8:pos + 8 + n]
        pos += 12 + n
    return len(set(zlib.decompress(idat)))


def test_html_report_renders_plots_and_tables_in_chromium(tmp_path: Path) -> None:
    runs = [write_run(tmp_path / "single.jsonl", "single", [0.2 + 0.002 * i for i in range(40)], 0.15,
                      conditions=SINGLE),
            write_run(tmp_path / "chunked.jsonl", "chunked", [0.18 + 0.002 * i for i in range(40)], 0.06,
                      conditions=CHUNKED, failures=2),
            write_run(tmp_path / "pd.jsonl", "pd", [0.1 + 0.002 * i for i in range(40)], 0.04, conditions=PD)]
    page = tmp_path / "report.html"
    # at the median: 40 requests do not bound a p99 from above, so no p99 difference between them is measurable
    p = subprocess.run([sys.executable, "-m", "pdproxy", "report", *map(str, runs), "--html", str(page),
                        "--no-table", "--slo-percentile", "50"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    text = page.read_text()
    offline = text.replace("http://www.w3.org/2000/svg", "")  # the SVG namespace is a name, not a fetch
    assert "http://" not in offline and "https://" not in offline and "<link" not in offline and " src=" not in offline

    dom_run = chromium(tmp_path, "--dump-dom", page.as_uri())
    assert dom_run.returncode == 0, dom_run.stderr[-2000:]
    dom = Dom()
    dom.feed(dom_run.stdout)
    assert dom.body.get("data-rendered") == "5", (dom.body, dom.text.get("js-error"))
    assert not dom.text.get("js-error")
    labels = {"single", "chunked", "pd"}
    for plot in ("ttft", "itl", "tail_itl"):
        paths = [a for t, a, pl in dom.elements if t == "path" and pl == plot]
        assert {a.get("data-run") for a in paths} == labels, plot
        assert all(a["d"].count("L") >= 20 for a in paths), plot  # a real curve, not an empty stub
    circles = [a for t, a, pl in dom.elements if t == "circle" and pl == "tail_itl_by_start"]
    assert len(circles) == 120  # one point per successful request
    bars = [a for t, a, pl in dom.elements if t == "rect" and pl == "stages" and a.get("data-stage")]
    assert bars == []  # no traces given: the stage plot says so instead of inventing bars
    assert dom.text["verdict"].startswith("Verdict: ADOPT (pd vs single, chunked)")
    metric_tables = [a for t, a, _ in dom.elements if t == "table" and a.get("id") == "metrics"]
    assert metric_tables

    shot = tmp_path / "shot.png"
    s = chromium(tmp_path, "--window-size=1200,1600", f"--screenshot={shot}", page.as_uri())
    assert s.returncode == 0 and shot.exists(), s.stderr[-2000:]
    assert png_distinct_bytes(shot) > 50


def test_html_stage_bars_from_traces(tmp_path: Path) -> None:
    """With traces, the stage breakdown draws one bar segment per stage present."""
    run = write_run(tmp_path / "pd.jsonl", "pd", [0.1] * 5, 0.04, conditions=PD)
    spans = []
    for i in range(5):
        tid, root = f"{i + 1:032x}", f"{i + 1:016x}"
        spans.append({"traceId": tid, "spanId": root, "name": "chat m", "kind": 2, "startTimeUnixNano": "0",
                      "endTimeUnixNano": "500000000",
                      "attributes": [{"key": "pd.request_id", "value": {"stringValue": f"pd-{i}"}}]})
        t = 0
        for j, (stage, ms) in enumerate((("queue", 1), ("prefill", 20), ("kv_transfer", 30), ("decode", 80))):
            spans.append({"traceId": tid, "spanId": f"{i + 1:08x}{j + 1:08x}", "parentSpanId": root,
                          "name": f"pd.{stage}", "startTimeUnixNano": str(t), "endTimeUnixNano": str(t + ms * 10**6)})
            t += ms * 10**6
    tf = tmp_path / "t.jsonl"
    tf.write_text(json.dumps({"resourceSpans": [{"resource": {}, "scopeSpans": [{"spans": spans}]}]}) + "\n")
    page = tmp_path / "r.html"
    p = subprocess.run([sys.executable, "-m", "pdproxy", "report", str(run), "--traces", str(tf), "--html", str(page),
                        "--no-table"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    dom = Dom()
    dom.feed(chromium(tmp_path, "--dump-dom", page.as_uri()).stdout)
    assert dom.body.get("data-rendered") == "5"
    bars = [a for t, a, pl in dom.elements if t == "rect" and pl == "stages" and a.get("data-stage")]
    assert [b["data-stage"] for b in bars] == ["queue", "prefill", "kv_transfer", "decode"]
    widths = [float(b["width"]) for b in bars]
    assert widths[3] > widths[2] > widths[1] > widths[0]  # 80 > 30 > 20 > 1 ms


def test_one_outlier_does_not_flatten_the_plots(tmp_path: Path) -> None:
    """Times on log axes: with one 8.9 s gap among 40 ms ones the other requests still spread out."""
    run = write_run(tmp_path / "pd.jsonl", "pd", [0.1 + 0.003 * i for i in range(40)], 0.04, conditions=PD)
    lines = run.read_text().splitlines()
    first = json.loads(lines[1])
    first["itl"][-1] = 8.9
    lines[1] = json.dumps(first)
    run.write_text("\n".join(lines) + "\n")
    page = tmp_path / "r.html"
    p = subprocess.run([sys.executable, "-m", "pdproxy", "report", str(run), "--html", str(page), "--no-table"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    dom = Dom()
    dom.feed(chromium(tmp_path, "--dump-dom", page.as_uri()).stdout)
    assert dom.body.get("data-rendered") == "5", dom.text.get("js-error")
    svgs = {pl: a for t, a, pl in dom.elements if t == "svg" and pl}
    assert all(svgs[k].get("data-log-x") == "1" for k in ("ttft", "itl", "tail_itl"))
    assert svgs["tail_itl_by_start"].get("data-log-y") == "1"
    ys = sorted(float(a["cy"]) for t, a, pl in dom.elements if t == "circle" and pl == "tail_itl_by_start")
    top, bottom = 8, 300 - 40  # the plot area of a 300-pixel-high frame
    # the 39 ordinary requests (40 ms) sit well above the axis, the outlier near the top
    assert ys[0] < top + 0.1 * (bottom - top) and ys[-1] < bottom - 0.1 * (bottom - top)  # linear: 1 px above
    tail = next(a for t, a, pl in dom.elements if t == "path" and pl == "tail_itl")
    xs = [float(pt.split(",")[0]) for pt in tail["d"].replace("M", "").split(" L")]
    assert xs[len(xs) // 2] > 56 + 0.1 * (560 - 68)  # (linear: 2 px) the median of the CDF is not squeezed against the y axis
