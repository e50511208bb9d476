"""What a newcomer reads first: the commands' help, the environment variables it promises, packaging metadata."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pdproxy.cli import SUBCOMMANDS
from pdproxy.config import Settings, add_arguments, load_settings

ROOT = Path(__file__).resolve().parent.parent


def help_text(*args: str) -> str:
    p = subprocess.run([sys.executable, "-m", "pdproxy", *args, "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_top_level_help_says_what_the_tool_does_for_a_user() -> None:
    text = help_text()
    assert "owned by its own module" not in text
    for words in ("vLLM", "prefill", "decode", "trace", "pdproxy demo"):
        assert words in text, words


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_flag_is_described(command: str) -> None:
    parser = argparse.ArgumentParser()
    importlib.import_module(SUBCOMMANDS[command][0]).add_arguments(parser)
    undescribed = [a.option_strings for a in parser._actions if not a.help]
    assert not undescribed, undescribed


def test_demo_help_says_where_results_go() -> None:
    text = help_text("demo")
    assert "--output-dir DIR" in text and "pdproxy-demo-YYYYmmdd-HHMMSS" in text and "--seed" in text


def test_serve_help_says_every_flag_has_an_environment_variable() -> None:
    assert "PDPROXY_<FLAG>" in " ".join(help_text("serve").split())


# one value per serve flag, different from its default; keyed by the flag's name
TOKENIZER_FILE = Path(__file__).parent / "fixtures" / "kv_events_vllm023" / "README.md"  # any readable file
SAMPLES = {
    "kv_events_endpoint": "tcp://{host}:5557", "kv_events_replay_endpoint": "tcp://{host}:5567",
    "kv_events_topic": "kv@", "kv_events_instance": "d:1=tcp://d:5557", "kv_events_replay_instance": "d:1=tcp://d:5567",
    "kv_events_ports": "5557", "kv_events_replay_ports": "5567",
    "kv_events_max_blocks": "1000", "tokenizer_file": str(TOKENIZER_FILE),
    "pd_min_prefill_tokens": "64",
    "dns_prefill": "prefill.test", "dns_decode": "decode.test:8200", "dns_port": "8000", "dns_interval": "2",
    "dns_server": "127.0.0.1:5353", "dns_kv_events_port": "kv-events",
    "host": "0.0.0.0", "port": "8123", "prefiller_hosts": "10.0.0.1", "prefiller_ports": "9100",
    "decoder_hosts": "10.0.0.2", "decoder_ports": "9200", "prefill": "http://10.0.0.3:8100",
    "decode": "http://10.0.0.4:8200", "model": "m", "policy": "least_inflight", "prefill_policy": "least_inflight",
    "decode_policy": "least_inflight", "connect_timeout": "3", "read_timeout": "30", "prefill_retries": "2",
    "decode_retries": "2", "first_token_timeout": "3", "decode_deadline": "20", "migrate_mid_stream": "1",
    "retry_backoff": "0.5", "max_retry_wait": "5", "health_check_interval": "1",
    "health_check_timeout": "1", "health_check_path": "/ready", "eject_after_failures": "5", "eject_seconds": "20",
    "max_ejection_percent": "100", "upstream_keep_alive": "2",
    "max_inflight": "8", "max_queue": "16", "queue_timeout": "5", "max_body_bytes": "4096", "body_timeout": "5",
    "write_timeout": "5", "keep_alive_timeout": "5", "client_kv_params": "strip", "workers": "2",
    "api_key": "k", "upstream_api_key": "u", "debug_endpoints": "1", "no_tracing": "1",
    "otlp_endpoint": "http://collector:4317", "otlp_protocol": "http/protobuf", "trace_file": "/tmp/t.jsonl",
    "trace_file_max_bytes": "2097152", "trace_file_backups": "1", "trace_rejected_rate": "2.5",
    "span_queue_size": "16", "stall_threshold": "0.2", "no_stall_attribution": "1", "run_label": "r", "gpu_count": "2",
    "resource_attr": "gpu.kind=H200",
    "served_model_name": "a,b", "capture_content": "1", "log_level": "debug", "shadow_url": "http://10.0.0.5:8000",
    "shadow_prefill": "http://10.0.0.6:8100", "shadow_sample_rate": "0.5", "shadow_max_inflight": "4",
    "shadow_timeout": "5", "cache_threshold": "0.5", "balance_abs_threshold": "8", "balance_rel_threshold": "2",
    "max_tree_size": "1000", "hash_key": "body:user", "load_metrics_interval": "0.5",
    "hash_load_factor": "2",
    "service_discovery": "1", "prefill_selector": "app=vllm,role=prefill", "decode_selector": "app=vllm role=decode",
    "selector": "app=vllm", "service_discovery_namespace": "vllm", "service_discovery_port": "8000",
    "service_discovery_resync": "30",
    "vllm_pd_disaggregation": "1", "worker_urls": "http://10.0.0.7:8000", "instances_file": "/tmp/instances.yaml",
    "instances_file_interval": "2", "admin_api_key": "a", "no_admin_api": "1", "drain_timeout": "5",
    "instance_series_retention": "10",
}
NEEDS = {"shadow_prefill": {"PDPROXY_SHADOW_URL": "http://10.0.0.5:8000"},  # not valid on its own
         "service_discovery": {"PDPROXY_SELECTOR": "app=vllm"}}


def serve_flags() -> list[str]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    names = []
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if action.dest == "ignored_flags":  # vllm-router's, accepted with no effect: nothing to set
            continue
        if longs and longs[0] not in ("--help", "--config"):
            names.append(longs[0][2:].replace("-", "_"))
    return names


def test_serve_help_groups_flags_as_an_operator_looks_for_them() -> None:
    """Before: 35 of 76 flags under one "routing and reliability" heading."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    groups = {g.title: [a.option_strings[0] for a in g._group_actions] for g in parser._action_groups}
    assert max(len(flags) for flags in groups.values()) <= 16, {t: len(f) for t, f in groups.items()}
    assert "--policy" in groups["routing (which instance gets a request)"]
    assert {"--decode-retries", "--migrate-mid-stream"} <= set(groups["retries and migration (what the client does not see)"])
    assert {"--eject-after-failures", "--health-check-interval"} <= set(groups["health checks and ejection"])
    assert {"--max-inflight", "--max-queue", "--max-body-bytes"} <= set(groups["admission and client limits"])
    assert groups["server processes"] == ["--workers"]
    text = " ".join(help_text("serve").split())
    for said in ("bootstrap port (or 'none') may follow the URL: accepted and ignored",
                 "only with --max-inflight set", "labels metrics (for more names, or aliases, see",
                 "5557 5558 5559 5560 for 2P2D on one host", "at least this fraction of the prompt (0.3: 30%)"):
        assert said in text, said
    assert text.count("(repeatable") >= 5


def test_kv_event_ports_in_instance_order_and_the_index_template() -> None:
    """2P2D on one host: one list instead of eight --kv-events-*-instance flags."""
    from pdproxy.config import ConfigError, kv_event_endpoints

    env = {"PDPROXY_PREFILL": "http://h:8100,http://h:8101", "PDPROXY_DECODE": "http://h:8200,http://h:8201"}
    s = load_settings(argparse.Namespace(kv_events_ports=[5557, 5558, 5559, 5560],
                                         kv_events_replay_ports=[5567, 5568, 5569, 5570]), environ=env)
    assert kv_event_endpoints(s) == [(f"h:{p}", f"tcp://h:{5557 + i}", f"tcp://h:{5567 + i}")
                                     for i, p in enumerate((8100, 8101, 8200, 8201))]
    s = load_settings(argparse.Namespace(kv_events_endpoint="tcp://{host}:{index}5"), environ=env)
    assert [e for _, e, _ in kv_event_endpoints(s)] == ["tcp://h:05", "tcp://h:15", "tcp://h:25", "tcp://h:35"]
    with pytest.raises(ConfigError, match=r"--kv-events-ports gives 3 port\(s\) for 4 instances"):
        load_settings(argparse.Namespace(kv_events_ports=[5557, 5558, 5559]), environ=env)
    p = subprocess.run([sys.executable, "-m", "pdproxy", "serve", "--decode", "http://h:8200",
                        "--kv-events-ports", "70000"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "port 70000 is out of range" in p.stderr and "Traceback" not in p.stderr


def test_samples_cover_every_serve_flag() -> None:
    assert sorted(SAMPLES) == sorted(serve_flags())


@pytest.mark.parametrize("flag", serve_flags())
def test_every_serve_flag_can_be_set_as_PDPROXY_FLAG_or_in_the_file(flag: str, tmp_path: Path) -> None:
    base = {} if flag == "decode" else {"PDPROXY_DECODE": "http://d:1", **NEEDS.get(flag, {})}
    from_env = load_settings(argparse.Namespace(), environ={**base, f"PDPROXY_{flag.upper()}": SAMPLES[flag]})
    assert from_env != load_settings(argparse.Namespace(), environ=base)
    config = tmp_path / "settings.yaml"  # the flag's name is a key of the YAML file too
    config.write_text(f"{flag.replace('_', '-')}: {SAMPLES[flag]!r}\n")
    assert load_settings(argparse.Namespace(config=str(config)), environ=base) == from_env


def test_negated_flag_in_the_environment_turns_tracing_off() -> None:
    s = load_settings(argparse.Namespace(), environ={"PDPROXY_NO_TRACING": "1"})
    assert s.tracing is False and load_settings(argparse.Namespace(), environ={}).tracing is True
    assert load_settings(argparse.Namespace(), environ={"PDPROXY_NO_TRACING": "0"}).tracing is True
    assert load_settings(argparse.Namespace(), environ={"PDPROXY_SERVED_MODEL_NAME": "a, b"}).served_model_name == [
        "a", "b"]
    assert Settings().served_model_name == []


def test_license_is_an_spdx_expression_with_a_setuptools_that_reads_it() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"  # the table form is deprecated (setuptools warns)
    (setuptools,) = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    assert tuple(int(x) for x in setuptools.split(">=")[1].split(".")) >= (77,)  # SPDX strings: setuptools 77


def test_demo_results_are_ignored_by_git() -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    p = subprocess.run(["git", "check-ignore", "-q", "pdproxy-demo-20261201-101010/report.json"], cwd=ROOT,
                       timeout=30)
    assert p.returncode == 0, "the demo's default run directory is not in .gitignore"


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def documented_commands() -> list[tuple[str, bool]]:
    """("file:line: command", whole) for every pdproxy command in README.md and docs/: each line of a code
    block that runs pdproxy (continuation lines joined, leading VAR=value assignments and a trailing comment or
    `&` dropped) is a whole command; each `pdproxy ...` span in the prose is a fragment that names a command."""
    out = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        fence = False
        n = 0
        while n < len(lines):
            line, where = lines[n], f"{path.relative_to(ROOT)}:{n + 1}"
            if line.strip().startswith("```"):
                fence = not fence
            elif fence:
                while line.rstrip().endswith("\\") and n + 1 < len(lines):
                    n += 1
                    line = line.rstrip()[:-1] + " " + lines[n].strip()
                for part in re.split(r"&&|;|\|", line.split(" #")[0]):
                    words = part.split()
                    while words and ENV_ASSIGNMENT.match(words[0]):
                        words = words[1:]
                    if words[:1] == ["pdproxy"]:
                        out.append((f"{where}: {' '.join(words).rstrip(' &')}", True))
            else:
                out += [(f"{where}: {m.group(1)}", False) for m in re.finditer(r"`(pdproxy [^`]+)`", line)]
            n += 1
    return out


def options(command: str) -> set[str]:
    from pdproxy.cli import build_parser

    parser = build_parser([command])
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return {s for action in sub._actions for s in action.option_strings}


def test_every_command_in_the_docs_parses() -> None:
    """A command the README or docs/ shows must still be one: a whole command (a code block's line) parses
    as `pdproxy` parses it, with no unknown argument; a command named in the prose (`pdproxy report
    --traces`) is a command whose every flag exists. Not run: parsing is what --help describes."""
    import contextlib
    import io

    from pdproxy.cli import build_parser

    found = documented_commands()
    assert len(found) >= 100 and sum(whole for _, whole in found) >= 30, len(found)
    bad = []
    for where, whole in found:
        argv = shlex.split(where.split(": ", 1)[1])[1:]
        if not argv or argv[0].isupper():  # `pdproxy COMMAND --help`: a placeholder for every command
            continue
        if argv[0] not in SUBCOMMANDS and not argv[0].startswith("-"):
            bad.append(f"{where}: no command {argv[0]!r}")
            continue
        if not whole:
            known = {"--help", "--version"} if argv[0].startswith("-") else options(argv[0]) | {"--help"}
            unknown = {a.split("=")[0] for a in argv if a.startswith("--")} - known
            if unknown:
                bad.append(f"{where}: {sorted(unknown)} not among `pdproxy {argv[0]} --help`'s flags")
            continue
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                _, unknown_args = build_parser(argv).parse_known_args(argv)
        except SystemExit as e:
            if e.code:
                bad.append(f"{where}: {err.getvalue().strip().splitlines()[-1]}")
            continue
        if unknown_args:
            bad.append(f"{where}: unrecognized arguments {unknown_args}")
    assert not bad, "\n".join(bad)


def test_every_link_in_the_docs_leads_somewhere() -> None:
    """The docs were moved into how-to/, reference/, explanation/ and notes/: every relative link of README.md,
    docs/ and the folders' READMEs names a file that exists, and a heading of it when it names one (GitHub's
    anchors: lower case, punctuation dropped, spaces to hyphens)."""

    def anchors(path: Path) -> set[str]:
        heads, fence = set(), False
        for line in path.read_text().splitlines():
            fence ^= line.strip().startswith("```")
            if not fence and line.startswith("#"):
                heads.add(re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-"))
        return heads

    pages = [*DOCS, *(ROOT / d / "README.md" for d in ("collector", "deploy", "grafana"))]
    bad, seen = [], 0
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            seen += 1
            if not linked.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                bad.append(f"{page.relative_to(ROOT)}: {target}: no such heading")
    assert seen >= 100 and not bad, "\n".join(bad)
