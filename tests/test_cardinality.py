"""Made-up model names leave /metrics and the proxy's memory flat (benchmarks/cardinality.py, bounded).

Real processes: a simulated instance serving `sim-model` (404 for any other name) and the proxy.
The benchmark warms both up, then sends one request per distinct made-up name; the numbers it
prints for 10,000 names are in docs/reference/telemetry.md. Before the bound, each name added ~128
series and ~37 KiB of resident memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "cardinality.py"
NAMES = 1500


def test_distinct_model_names_leave_series_and_memory_flat(tmp_path) -> None:
    p = subprocess.run([sys.executable, str(BENCH), "--names", str(NAMES), "--json", "--logs", str(tmp_path)],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    result = json.loads(p.stdout)
    before, after = result["before"], result["after"]
    assert result["statuses"] == {"404": NAMES}  # the instance refused every made-up name
    assert result["served_statuses"] == {"200": 20}
    assert after["series"] == before["series"], (before["series"], after["series"])
    assert after["metrics_bytes"] < before["metrics_bytes"] * 1.05  # only counter values grow by a digit
    growth = after["rss_bytes"] - before["rss_bytes"]
    assert growth < 8 * 2**20, f"RSS grew {growth / 2**20:.1f} MiB over {NAMES} names"  # unbounded: ~55 MiB
    assert after["model_labels"] == ["other", "sim-model"]  # the served model keeps its own label


def test_listed_names_are_capped_given_names_are_not_and_answers_add_none() -> None:
    from pdproxy.telemetry.models import OTHER, ModelNames

    names = ModelNames(["given"], max_learned=3)
    for i in range(10):  # an instance listing more models in /v1/models than the cap
        names.learn(f"listed-{i}")
    names.learn("x" * 1000)
    assert names.learned == {"listed-0", "listed-1", "listed-2"}
    assert names.label("given") == "given" and names.label("listed-1") == "listed-1"
    assert names.label("listed-7") == OTHER and names.label(None) == OTHER and names.label(["a"]) == OTHER
    assert names.label("alias-of-given", answered="given") == "given"  # answered by a known model
    assert names.label("made-up", answered="made-up") == OTHER  # an echoed name is the client's own
    assert names.label("made-up") == OTHER and names.learned == {"listed-0", "listed-1", "listed-2"}


def test_status_codes_outside_the_known_set_are_labelled_by_class() -> None:
    from pdproxy.telemetry.metrics import status_label

    assert [status_label(s) for s in (200, 404, 429, 499, 502)] == ["200", "404", "429", "499", "502"]
    assert [status_label(s) for s in (206, 418, 451, 507, 599, 42, 1000)] == ["2xx", "4xx", "4xx", "5xx", "5xx",
                                                                              "other", "other"]


def test_the_collector_keys_only_on_bounded_attributes() -> None:
    """span_metrics and signal_to_metrics turn attributes into series: only bounded ones may be keys."""
    import yaml

    bounded = {"gen_ai.request.model",  # a served model or `other` (pdproxy/telemetry/models.py)
               "pd.run", "service.name", "server.address",  # the operator's
               "pd.deployment", "pd.mode", "pd.failed_stage",  # pdproxy's fixed lists
               "pd.stall.cause"}  # never on a span: a constant label, one rule per cause (telemetry/stalls.py)
    collector = Path(__file__).resolve().parent.parent / "collector"
    for path in sorted(collector.glob("otelcol*.yaml")):
        connectors = yaml.safe_load(path.read_text()).get("connectors") or {}
        keys = {d["name"] for d in (connectors.get("span_metrics") or {}).get("dimensions") or []}
        for rule in ((connectors.get("signal_to_metrics") or {}).get("spans") or []):
            keys |= {a["key"] for a in rule.get("attributes") or []}
            keys |= {a["key"] for a in rule.get("include_resource_attributes") or []}
        assert keys <= bounded, (path.name, keys - bounded)


def test_an_echoing_backend_teaches_no_model_names() -> None:
    """An instance that answers as whatever model was asked for (some OpenAI-compatible servers do): the
    answers' `model` picks among the names it lists in /v1/models but adds none. Before, every echoed
    name up to the cap of 100 got its own label (~300 series each)."""
    import asyncio

    import httpx

    from procs import start_proxy, start_scripted
    from waits import wait_until

    procs = []
    try:
        backend, burl = start_scripted("decode", "--echo-model")
        procs.append(backend)
        proxy, url = start_proxy("--decode", burl, "--health-check-interval", "0")
        procs.append(proxy)
        wait_until(lambda: httpx.get(url + "/status").json()["model_labels"]["learned"] == ["scripted-model"],
                   "the proxy to read the instance's /v1/models")

        async def send(models: list[str], concurrency: int = 16) -> dict[str, int]:
            """Answers by status; each 200 is checked to name the model that was asked for."""
            queue, statuses = list(models), {}
            async with httpx.AsyncClient(timeout=30) as client:
                async def worker() -> None:
                    while queue:
                        model = queue.pop()
                        r = await client.post(url + "/v1/completions",
                                              json={"model": model, "prompt": "a", "max_tokens": 1})
                        statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1
                        assert r.status_code != 200 or r.json()["model"] == model, "the backend does not echo"
                await asyncio.gather(*(worker() for _ in range(concurrency)))
            return statuses

        # every series a request can open, for the listed name and for `other`, before counting
        assert asyncio.run(send(["scripted-model", "warm-1", "warm-2"] * 3)) == {"200": 9}
        before = series(httpx.get(url + "/metrics").text)
        made_up = [f"made-up-{i:04d}" for i in range(1000)]
        assert asyncio.run(send(made_up)) == {"200": 1000}  # every one answered as the made-up model
        after = series(httpx.get(url + "/metrics").text)
        assert after == before, f"{len(after - before)} new series, e.g. {sorted(after - before)[:3]}"
        labels = {dict(labels).get("model") for _, labels in after} - {None}
        assert labels == {"other", "scripted-model"}
        status = httpx.get(url + "/status").json()["model_labels"]
        assert status["learned"] == ["scripted-model"], status
    finally:
        for proc in reversed(procs):
            proc.stop()


def series(text: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """Every (name, labels) sample of a Prometheus text page."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items())))
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_with_health_checks_off_the_listing_is_still_asked(monkeypatch) -> None:
    """Answers teach no names, so an instance that comes up after the proxy must still be asked: with
    `interval` 0 the watch goes on (every MIN_REFRESH_SECONDS, shortened here), of the instances there are at
    each refresh (they come and go)."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from pdproxy import served
    from pdproxy.telemetry import models
    from procs import HOST, free_port

    monkeypatch.setattr(served, "MIN_REFRESH_SECONDS", 0.05)
    port = free_port()

    async def scenario() -> set[str]:
        names = models.ModelNames()
        app = web.Application()
        async def listing(request: web.Request) -> web.Response:
            return web.json_response({"data": [{"id": "late-model"}]})

        app.router.add_get("/v1/models", listing)
        runner = web.AppRunner(app)
        await runner.setup()
        async with aiohttp.ClientSession() as session:
            watch = asyncio.create_task(served.ServedModels(names).watch(session, lambda: [f"http://{HOST}:{port}"],
                                                                         {}, 0, 1.0))
            await asyncio.sleep(0.3)  # several refreshes against a port nothing listens on yet
            assert not watch.done() and names.learned == set()
            await web.TCPSite(runner, HOST, port).start()
            for _ in range(200):
                if names.learned:
                    break
                await asyncio.sleep(0.05)
            assert not watch.done()
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        await runner.cleanup()
        return names.learned

    assert asyncio.run(scenario()) == {"late-model"}
