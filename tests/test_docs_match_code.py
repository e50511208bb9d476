"""What the docs and the help say of the code is what the code does (issue 54 item 9).

Three kinds of claim drift silently: a metric's labels (a series queried with a label it does not have
matches nothing), a flag (an operator looks for a pdproxy flag that is vLLM's, or gone), and a flag's help
against the behaviour it describes.
"""

from __future__ import annotations

import re
from pathlib import Path

from test_grafana_dashboards import contract_metrics

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
MENTION = re.compile(r"`(pdproxy_[a-z0-9_]+)\{([^}`]*)\}")
SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def pdproxy_flags() -> set[str]:
    """Every option string of every pdproxy subcommand."""
    from pdproxy import cli

    flags: set[str] = set()
    for name in cli.SUBCOMMANDS:
        parser = cli.build_parser([name])
        sub = next(a for a in parser._actions if a.dest == "command").choices[name]
        flags |= {s for action in sub._actions for s in action.option_strings}
    return flags


def test_metric_labels_named_in_the_docs_are_the_metrics_own():
    base, metrics = contract_metrics()  # docs/reference/telemetry.md's table, itself checked against the exposition
    seen = 0
    for doc in DOCS:
        for name, labels in MENTION.findall(doc.read_text()):
            metric = next((m for m in (name, *(name.removesuffix(s) for s in SUFFIXES if name.endswith(s)))
                           if m in metrics), None)
            if metric is None:
                continue  # not in the table (the kv-event collector's families are checked in their own tests)
            named = set(re.findall(r"([a-z_]+)\s*(?:=|!=|=~|!~|,|$)", labels.strip()))
            allowed = set(base) | metrics[metric][1] | {"le"}
            assert named <= allowed, f"{doc.name}: {name}{{{labels}}}: {named - allowed} is not a label of {metric}"
            seen += 1
    assert seen >= 5


def test_flags_the_runbooks_name_are_pdproxys_or_said_to_be_vllms():
    """An operator paged at night reads a runbook's flag as pdproxy's unless it says whose it is."""
    flags = pdproxy_flags()
    text = (REPO / "docs" / "reference" / "runbooks.md").read_text()
    named = 0
    for match in re.finditer(r"`(--[a-z][a-z0-9-]*)(\*?)`", text):
        flag, wildcard = match.groups()
        named += 1
        if flag in flags or wildcard and any(f.startswith(flag) for f in flags):
            continue
        before = text[max(0, match.start() - 60):match.start()]
        assert "vLLM" in before, f"docs/reference/runbooks.md names {flag} as if pdproxy had it: ...{before}{match.group()}"
    assert named >= 10


def test_the_tokenizer_file_help_says_where_text_and_chat_go_without_it():
    """Without --tokenizer-file, routing by token ids asks the decode instances' /tokenize for text and chat
    (pdproxy/routing/__init__.py); the help must not say that only token-id prompts route by events."""
    from pdproxy import cli

    parser = cli.build_parser(["serve"])
    serve = next(a for a in parser._actions if a.dest == "command").choices["serve"]
    help_text = next(a.help for a in serve._actions if "--tokenizer-file" in a.option_strings)
    assert "/tokenize" in help_text and "only token-id" not in help_text, help_text
    from pdproxy.pool import Pool  # a real one: compiled, the router takes nothing else
    from pdproxy.routing import build

    settings = type("S", (), {"pd_min_prefill_tokens": 0, "tokenizer_file": None})()
    metrics = type("M", (), {"tokenize_failure": staticmethod(lambda address, reason: None)})()
    router = build(settings, None, None, Pool("decode", ["http://127.0.0.1:1"], "precise_prefix"), object(), metrics,
                   {})
    assert type(router.tokens).__name__ == "RemoteTokenizer"  # what the help says
