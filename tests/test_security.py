"""Security: keys, what is never recorded, the debug endpoint, the default bind address, and
client-supplied kv_transfer_params (real processes)."""

import json
import time

import httpx

from ledgers import ScriptedGroup, spans_in
from procs import HOST, free_port, pdproxy, start_proxy
from waits import scaled

PROMPT = "PROMPT-SECRET-7f3a the launch code is 0000"
COMPLETION = "COMPLETION-SECRET-91bc"
CLIENT_KEY = "client-key-SECRET-4d2e"
UPSTREAM_KEY = "upstream-key-SECRET-a8f0"
SECRETS = (PROMPT, "PROMPT-SECRET-7f3a", COMPLETION, CLIENT_KEY, UPSTREAM_KEY, "WRONG-SECRET-55aa")


def completion_stream():
    event = {"id": "cmpl-s", "choices": [{"index": 0, "text": COMPLETION, "finish_reason": None}]}
    return ["data: " + json.dumps(event) + "\n\n", "data: [DONE]\n\n"]


def exercise(url, p, d):
    """Success, failures at each leg, bad input and bad keys, all carrying the secrets."""
    auth = {"Authorization": f"Bearer {CLIENT_KEY}"}
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "stream": True}
    d.script({"chunks": completion_stream()}, {"chunks": completion_stream(), "abort_after": 1})
    assert COMPLETION in httpx.post(url + "/v1/completions", json=body, headers=auth).text
    assert '"error"' in httpx.post(url + "/v1/completions", json=body, headers=auth).text
    p.script({"status": 500, "body": {"error": {"message": "engine died"}}})
    assert httpx.post(url + "/v1/completions", json=body, headers=auth).status_code == 502
    chat = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": "not a number"}
    assert httpx.post(url + "/v1/chat/completions", json=chat, headers=auth).status_code == 400
    assert httpx.post(url + "/v1/completions", content=PROMPT.encode(), headers=auth).status_code == 400
    wrong = {"Authorization": "Bearer WRONG-SECRET-55aa"}
    assert httpx.post(url + "/v1/completions", json=body, headers=wrong).status_code == 401


def test_no_prompt_completion_or_key_in_spans_logs_or_metrics(tmp_path):
    p, d = ScriptedGroup("prefill", 1), ScriptedGroup("decode", 1)
    trace_file = tmp_path / "spans.jsonl"
    proxy, url = start_proxy("--prefill", p.url, "--decode", d.url, "--api-key", CLIENT_KEY, "--trace-file",
                             str(trace_file), "--log-level", "debug", "--health-check-interval", "0",
                             "--prefill-retries", "0", "--decode-retries", "0",
                             env={"OPENAI_API_KEY": UPSTREAM_KEY, "OTEL_BSP_SCHEDULE_DELAY": "50"})
    try:
        exercise(url, p, d)
        assert all(e["headers"]["authorization"] == f"Bearer {UPSTREAM_KEY}" for e in d.journal())  # separate keys
        metrics = httpx.get(url + "/metrics").text
        deadline = time.monotonic() + scaled(5)
        while len([s for s in spans_in(trace_file) if s["kind"] == 2]) < 5 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        proxy.stop()
    spans, log = trace_file.read_text(), proxy.output()
    assert len([s for s in spans_in(trace_file) if s["kind"] == 2]) >= 5 and "pdproxy" in log
    for secret in SECRETS:
        assert secret not in spans and secret not in log and secret not in metrics, secret

    # the same check can fail: with --capture-content the prompt is recorded (and only then)
    captured = tmp_path / "captured.jsonl"
    proxy, url = start_proxy("--prefill", p.url, "--decode", d.url, "--trace-file", str(captured),
                             "--capture-content", "--health-check-interval", "0", env={"OTEL_BSP_SCHEDULE_DELAY": "50"})
    try:
        d.script()
        httpx.post(url + "/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 4})
        deadline = time.monotonic() + scaled(5)
        while "PROMPT-SECRET-7f3a" not in (captured.read_text() if captured.exists() else "") \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "PROMPT-SECRET-7f3a" in captured.read_text()
    finally:
        proxy.stop()
        p.stop()
        d.stop()


def test_api_key_check_takes_any_bytes_and_guards_the_debug_endpoint():
    d = ScriptedGroup("decode", 1)
    proxy, url = start_proxy("--decode", d.url, "--api-key", CLIENT_KEY, "--debug-endpoints",
                             "--health-check-interval", "0")
    plain, plain_url = start_proxy("--decode", d.url, "--health-check-interval", "0")
    try:
        for value in (b"Bearer \xff\xfe", b"\xc3\x28", b"Bearer  " + CLIENT_KEY.encode(), b"bearer " +
                      CLIENT_KEY.encode(), b"Bearer " + CLIENT_KEY[:-1].encode()):
            r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, headers={"Authorization": value})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", value
        ok = {"Authorization": f"Bearer {CLIENT_KEY}"}
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}, headers=ok).status_code == 200
        assert httpx.get(url + "/debug/runtime").status_code == 401
        assert httpx.get(url + "/debug/runtime", headers=ok).json()["tasks"] > 0
        off = httpx.get(plain_url + "/debug/runtime")  # not served unless asked for
        assert off.status_code == 404 and off.json()["error"]["type"] == "not_found_error"
    finally:
        proxy.stop()
        plain.stop()
        d.stop()


def test_binds_to_loopback_unless_told_otherwise():
    d = ScriptedGroup("decode", 1)
    port = free_port()
    proc = pdproxy("serve", "--port", str(port), "--decode", d.url, "--health-check-interval", "0")
    try:
        proc.wait_http(f"http://{HOST}:{port}/health")
        listening = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in open(table).read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    listening.add(local.rsplit(":", 1)[0])
        assert listening == {"0100007F"}  # 127.0.0.1 only
    finally:
        proc.stop()
        d.stop()


FORGED = {"do_remote_prefill": True, "remote_host": "evil.example", "remote_port": 1, "remote_block_ids": [[0]]}


def smuggling_bodies() -> dict[str, bytes]:
    """A client's kv_transfer_params in every spelling JSON decodes to the key, and in every encoding
    json.loads (and so vLLM) reads: a byte search for the key finds none of them but the literal one."""
    def text(key: str) -> str:
        return '{"model": "m", "prompt": "a b", "max_tokens": 2, "%s": %s}' % (key, json.dumps(FORGED))

    def xargs(key: str) -> str:  # vLLM copies vllm_xargs into extra_args, where connectors read the key
        return ('{"model": "m", "prompt": "a b", "max_tokens": 2, "vllm_xargs": {"keep": 1, "%s": %s}}'
                % (key, json.dumps(FORGED)))

    literal = text("kv_transfer_params")
    return {
        "literal": literal.encode(),
        "escaped underscore": text("kv\\u005ftransfer_params").encode(),
        "escaped letter": text("\\u006bv_transfer_params").encode(),
        "utf-16-le": literal.encode("utf-16-le"),  # no BOM: starts {\x00
        "utf-16-be": literal.encode("utf-16-be"),
        "utf-32-le": literal.encode("utf-32-le"),
        "utf-8 bom": literal.encode("utf-8-sig"),
        "vllm_xargs": xargs("kv_transfer_params").encode(),
        "vllm_xargs escaped": xargs("kv\\u005ftransfer_params").encode(),
    }


def post_raw(url: str, data: bytes) -> httpx.Response:
    return httpx.post(url + "/v1/completions", content=data, headers={"Content-Type": "application/json"})


def assert_no_client_params(entries: list[dict], what: str) -> None:
    assert entries, what
    for entry in entries:
        assert entry["body"] is not None, f"{what}: the instance got invalid JSON"
        assert "evil.example" not in json.dumps(entry["body"]), what
        assert entry["body"].get("kv_transfer_params", {}).get("remote_host") in (None, "10.0.0.1"), what


def test_client_kv_params_never_reach_the_decode_in_any_spelling_or_encoding():
    """Single mode, P/D with a prefill that returns no params, and a decode retry (fresh params from a
    second prefill): in `strip` mode the decode gets the checked object without the client's key (at
    the top or in `vllm_xargs`), and only ever a prefill's coordinates; in `reject` mode a 400."""
    p, d = ScriptedGroup("prefill", 1), ScriptedGroup("decode", 2)
    common = ("--health-check-interval", "0", "--prefill-retries", "0", "--decode-retries", "1",
              "--eject-after-failures", "0")
    proxies = {(mode, shape): start_proxy(*(("--prefill", p.url) if shape == "pd" else ()), "--decode", *d.urls,
                                          "--client-kv-params", mode, *common)
               for mode in ("strip", "reject") for shape in ("single", "pd")}
    no_params = {"body": {"id": "cmpl-p", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}}
    try:
        for name, data in smuggling_bodies().items():
            for (mode, shape), (_, url) in proxies.items():
                cases = {"direct": ([], [])} if shape == "single" else {
                    "prefill without params": ([no_params], []),
                    "decode retry": ([], [{"status": 500, "body": {"error": {"message": "engine died"}}}]),
                }
                for case, (prefill_steps, decode_steps) in cases.items():
                    what = f"{name}, {mode}, {shape}, {case}"
                    p.script(*prefill_steps)
                    d.script(*decode_steps)
                    r = post_raw(url, data)
                    if mode == "reject":
                        param = "vllm_xargs" if name.startswith("vllm_xargs") else "kv_transfer_params"
                        assert r.status_code == 400 and r.json()["error"]["param"] == param, what
                        assert d.journal() == [] and p.journal() == [], what
                        continue
                    assert r.status_code == 200, (what, r.text)
                    sent = d.journal()
                    assert len(sent) == (2 if case == "decode retry" else 1), what
                    assert_no_client_params(sent + p.journal(), what)
                    if name.startswith("vllm_xargs"):  # the client's other custom arguments go on
                        assert all(e["body"]["vllm_xargs"] == {"keep": 1} for e in sent + p.journal()), what
                    if case == "decode retry":  # the second prefill's coordinates, never the client's
                        assert sent[-1]["body"]["kv_transfer_params"]["remote_engine_id"] == "engine-p", what
                        assert len(p.journal()) == 2, what
                    else:  # no prefill params: no coordinates at all, the client's least of all
                        assert "kv_transfer_params" not in sent[-1]["body"], what
    finally:
        for proc, _ in proxies.values():
            proc.stop()
        p.stop()
        d.stop()


def test_utf16_and_utf32_bodies_reach_the_decode_as_valid_json_with_the_prefills_params():
    """The splice of the prefill's params into a client's raw bytes only happens to UTF-8 bodies:
    a UTF-16/32 body is re-serialised, so the decode never gets mixed encodings."""
    p, d = ScriptedGroup("prefill", 1), ScriptedGroup("decode", 1)
    proxy, url = start_proxy("--prefill", p.url, "--decode", d.url, "--health-check-interval", "0")
    try:
        text = '{"model": "m", "prompt": "caf\u00e9 \u4e16\u754c", "max_tokens": 2}'
        for encoding in ("utf-16-le", "utf-16-be", "utf-16", "utf-32-le", "utf-32", "utf-8-sig"):
            d.script()
            r = post_raw(url, text.encode(encoding))
            assert r.status_code == 200, (encoding, r.text)
            body = d.journal()[0]["body"]
            assert body is not None, f"{encoding}: the decode got invalid JSON"
            assert body["prompt"] == "caf\u00e9 \u4e16\u754c" and body["kv_transfer_params"]["remote_host"] == "10.0.0.1"
        # a body that is not UTF-8 and has no BOM or NUL to say otherwise is refused, not guessed
        r = post_raw(url, '{"prompt": "caf\u00e9"}'.encode("latin-1"))
        assert r.status_code == 400 and "UnicodeDecodeError" in r.json()["error"]["message"]
    finally:
        proxy.stop()
        p.stop()
        d.stop()


def test_client_kv_transfer_params_are_never_forwarded():
    p, d = ScriptedGroup("prefill", 1), ScriptedGroup("decode", 1)
    forged = {"do_remote_prefill": True, "remote_host": "evil.example", "remote_port": 1, "remote_block_ids": [[0]]}
    body = {"model": "m", "prompt": "a b", "max_tokens": 2, "kv_transfer_params": forged}
    proxy, url = start_proxy("--prefill", p.url, "--decode", d.url, "--health-check-interval", "0")
    strip, strip_url = start_proxy("--prefill", p.url, "--decode", d.url, "--client-kv-params", "strip",
                                   "--health-check-interval", "0")
    try:
        r = httpx.post(url + "/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
        assert p.journal() == [] and d.journal() == []
        assert httpx.post(strip_url + "/v1/completions", json=body).status_code == 200
        sent_p, sent_d = p.journal()[0]["body"], d.journal()[0]["body"]
        assert sent_p["kv_transfer_params"]["do_remote_decode"] is True  # the proxy's own, not the client's
        assert sent_d["kv_transfer_params"]["remote_host"] == "10.0.0.1"  # the prefill's, not the client's
        assert "evil.example" not in json.dumps([sent_p, sent_d])
    finally:
        proxy.stop()
        strip.stop()
        p.stop()
        d.stop()


def test_url_credentials_are_refused_for_instances_and_never_shown_for_the_otlp_endpoint(tmp_path):
    """One rule for URL credentials: instances get none (refused at start: the legs would drop them
    while health checks sent them), and no output shows the OTLP endpoint's."""
    password = "URL-SECRET-3c9d"
    d = ScriptedGroup("decode", 1)
    port = d.url.rsplit(":", 1)[1]
    refused = [("--decode", f"http://user:{password}@127.0.0.1:{port}"),
               ("--decode", d.url, "--prefill", f"http://user:{password}@127.0.0.1:1"),
               ("--decode", f"user:{password}@127.0.0.1:{port}"),
               ("--decode", d.url, "--shadow-url", f"https://{password}@127.0.0.1:1")]
    try:
        for args in refused:
            proc = pdproxy("serve", "--port", str(free_port()), "--health-check-interval", "0", *args)
            try:
                assert proc.popen.wait(30) == 2, args
            finally:
                proc.stop()
            assert password not in proc.output() and "***@" in proc.output(), proc.output()
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://otel:{password}@127.0.0.1:{free_port()}"}
        for flag in ((), ("--otlp-endpoint", f"http://otel:{password}@127.0.0.1:{free_port()}")):
            proxy, url = start_proxy("--decode", d.url, "--api-key", CLIENT_KEY, "--health-check-interval", "0",
                                     *flag, env=env)
            try:
                status = httpx.get(url + "/status").text
                assert password not in status and "***@127.0.0.1" in status, status
            finally:
                proxy.stop()
            assert password not in proxy.output() and "***@127.0.0.1" in proxy.output()
    finally:
        d.stop()


def test_models_listing_needs_the_api_key_like_the_rest_of_v1():
    d = ScriptedGroup("decode", 1)
    proxy, url = start_proxy("--decode", d.url, "--api-key", CLIENT_KEY, "--health-check-interval", "0")
    try:
        r = httpx.get(url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer WRONG-SECRET-55aa"}).status_code == 401
        r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {CLIENT_KEY}"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "scripted-model"
    finally:
        proxy.stop()
        d.stop()
