"""The loop-owned counters (issue 32) expose exactly what prometheus_client's Counter exposes for the
same increments, in both formats, so dashboards, alerts and the workers' merged exposition do not see
the change; only the per-request cost (no lock) differs."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from pdproxy.telemetry.metrics import LoopCounter

LABELS = ("route", "code")


def _exposition(make) -> list[str]:
    registry = CollectorRegistry(auto_describe=True)
    counter = make(registry)
    counter.labels("chat", "200").inc()
    counter.labels("chat", "200").inc(2.5)
    counter.labels("completions", "503")  # asked for, never incremented: exposed at 0
    counter.labels("chat", "500").inc(exemplar={"trace_id": "0af7651916cd43dd8448eb211c80319c"})
    return [generate_latest(registry).decode(), generate_openmetrics(registry).decode()]


def _strip_exemplar_time(text: str) -> str:
    """The exemplar's timestamp is the time of the increment: the two runs differ in it only."""
    return "\n".join(line.rsplit(" ", 1)[0] if " # {" in line else line for line in text.splitlines())


def test_a_loop_counter_exposes_what_a_prometheus_counter_does():
    disable_created_metrics()  # as pdproxy's Metrics does: no `_created` series
    theirs = _exposition(lambda r: Counter("pdproxy_things", "Things counted", LABELS, registry=r))
    ours = _exposition(lambda r: LoopCounter("pdproxy_things", "Things counted", LABELS, r))
    assert [_strip_exemplar_time(t) for t in ours] == [_strip_exemplar_time(t) for t in theirs]
    assert 'pdproxy_things_total{code="200",route="chat"} 3.5' in ours[1]
    assert '# {trace_id="0af7651916cd43dd8448eb211c80319c"} 1.0' in ours[1]


def test_a_loop_counter_refuses_the_wrong_number_of_labels():
    counter = LoopCounter("pdproxy_things", "Things counted", LABELS, CollectorRegistry())
    try:
        counter.labels("chat")
    except ValueError as exc:
        assert "expected labels" in str(exc)
    else:
        raise AssertionError("a label set of the wrong size was accepted")
