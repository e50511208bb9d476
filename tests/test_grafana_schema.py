"""Every generated dashboard against Grafana's own schema (tools/grafana-schema: Grafana's foundation SDK).

Grafana itself cannot run here (AGPL), so the dashboards were only ever checked by their queries. The
SDK's types are generated from Grafana's dashboard and panel-plugin schemas; decoded strictly, a field
Grafana does not know, a value of the wrong type or a required field left out fails, in the dashboard,
a panel, its options, its fieldConfig or a query.
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest

from gotools import build

DASHBOARDS = sorted((Path(__file__).resolve().parents[1] / "grafana" / "dashboards").glob("*.json"))


@pytest.fixture(scope="module")
def schema() -> Path:
    return build("tools/build-grafana-schema.sh")


def check(schema: Path, *paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(schema), *map(str, paths)], capture_output=True, text=True, timeout=60)


def test_every_generated_dashboard_decodes_strictly(schema: Path) -> None:
    assert len(DASHBOARDS) >= 2
    r = check(schema, *DASHBOARDS)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == [f"{p}: ok" for p in DASHBOARDS]


def first(d: dict, kind: str) -> dict:
    return next(p for p in d["panels"] if p["type"] == kind)


BREAKS = {
    # what each change does to a dashboard, and the error the check must name
    "unknown panel option": (lambda d: first(d, "stat")["options"].update(sparkline=True),
                             "unexpected field 'sparkline'"),
    "unknown field in fieldConfig.defaults": (
        lambda d: first(d, "timeseries")["fieldConfig"]["defaults"].update(lineColour="red"),
        "unexpected field 'lineColour'"),
    "unknown field in fieldConfig.defaults.custom": (
        lambda d: first(d, "timeseries")["fieldConfig"]["defaults"].setdefault("custom", {}).update(fillOpacityy=5),
        "unexpected field 'fillOpacityy'"),
    "wrong type": (lambda d: first(d, "timeseries")["gridPos"].update(w="wide"), "gridPos.w"),
    "unknown dashboard field": (lambda d: d.update(refreshInterval="10s"), "unexpected field 'refreshInterval'"),
    "unknown Prometheus query field": (lambda d: first(d, "timeseries")["targets"][0].update(exprs="up"),
                                       "unexpected field 'exprs'"),
    "legend left out": (lambda d: first(d, "timeseries")["options"]["legend"].pop("showLegend"),
                        "showLegend: required field is missing"),
    "a panel type nothing checks": (lambda d: d["panels"].append({**first(d, "stat"), "type": "piechart"}),
                                    'panel type "piechart" is not checked'),
}


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_a_field_grafana_would_not_take_fails(schema: Path, tmp_path: Path, name: str) -> None:
    change, error = BREAKS[name]
    d = copy.deepcopy(json.loads(DASHBOARDS[0].read_text()))
    change(d)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(d))
    r = check(schema, broken)
    assert r.returncode == 1 and error in r.stdout, r.stdout + r.stderr
