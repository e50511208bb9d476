"""Token ids for routing from the instances' /tokenize, on real processes (issue 39, items 8 and 9).

Simulated instances behind tests/tokenize_backend.py, whose /tokenize a test makes forward, hang or answer
nonsense; pdproxy with selective disaggregation (--pd-min-prefill-tokens), which asks /tokenize for text and
chat prompts. A chat is counted with everything vLLM's chat tokenize request takes (tools, template
arguments, ...), and one whose ids cannot count all of it (media parts, documents) keeps its prefill. A
/tokenize that hangs is backed off (another instance is asked, then none for a while), one that answers an
impossible count is not believed, and every failure is counted per instance."""

from __future__ import annotations

import time

import httpx

from procs import Proc, start_proxy, start_sim, start_tokenize_backend
from waits import scaled


def call(url: str, body: dict | None = None):
    r = httpx.post(url, json=body, timeout=scaled(20)) if body is not None else httpx.get(url, timeout=scaled(20))
    r.raise_for_status()
    return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text


def complete(url: str, path: str, body: dict) -> None:
    call(url + path, {"model": "sim-model", "max_tokens": 2, **body})


def counts(url: str, name: str) -> dict[str, float]:
    return {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
            for line in call(url + "/metrics").splitlines() if line.startswith(name + "{")}


def verdicts(url: str) -> dict[str, float]:
    return counts(url, "pdproxy_disaggregation_decisions_total")


def stack(n_decodes: int, *flags: str) -> tuple[list[Proc], str, str, list[str]]:
    """A simulated prefill, `n_decodes` simulated decodes each behind a tokenize backend, and pdproxy."""
    procs: list[Proc] = []
    prefill, p_url = start_sim("prefill", "--preset", "instant")
    procs.append(prefill)
    fronts = []
    for _ in range(n_decodes):
        decode, d_url = start_sim("decode", "--preset", "instant")
        procs.append(decode)
        backend, b_url = start_tokenize_backend(d_url)
        procs.append(backend)
        fronts.append(b_url)
    args = ["--prefill", p_url, "--health-check-interval", "0", "--pd-min-prefill-tokens", "64", *flags]
    for b_url in fronts:
        args += ["--decode", b_url]
    proxy, url = start_proxy(*args)
    procs.append(proxy)
    return procs, url, p_url, fronts


def test_chat_is_counted_with_its_tools_or_not_at_all():
    procs, url, _, (front,) = stack(1)
    try:
        tools = [{"type": "function", "function": {"name": f"tool_{k}", "description": "looks things up " * 40,
                                                   "parameters": {"type": "object", "properties": {}}}}
                 for k in range(60)]
        hi = [{"role": "user", "content": "hi"}]
        complete(url, "/v1/chat/completions", {"messages": hi, "tools": tools, "chat_template_kwargs": {"think": False},
                                               "continue_final_message": False, "add_generation_prompt": True})
        asked = call(front + "/_tokenize")["calls"]
        assert len(asked) == 1 and asked[0]["tools"] == tools and asked[0]["chat_template_kwargs"] == {"think": False}
        assert asked[0]["continue_final_message"] is False and asked[0]["messages"] == hi
        assert verdicts(url) == {'decision="disaggregated",reason="long_uncached"': 1.0}  # the tools are thousands
        complete(url, "/v1/chat/completions", {"messages": hi})
        assert verdicts(url)['decision="decode_only",reason="short_uncached"'] == 1.0
        # ids that leave part of the request out are not a count: media parts, documents
        image = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                              {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
        complete(url, "/v1/chat/completions", {"messages": image})
        complete(url, "/v1/chat/completions", {"messages": hi, "documents": [{"title": "t", "text": "a long one " * 500}]})
        assert verdicts(url) == {'decision="disaggregated",reason="long_uncached"': 1.0,
                                 'decision="decode_only",reason="short_uncached"': 1.0,
                                 'decision="disaggregated",reason="not_countable"': 2.0}
    finally:
        for proc in procs:
            proc.stop()


def test_a_hanging_tokenize_is_backed_off_and_an_impossible_count_refused():
    procs, url, _, (hanging, healthy) = stack(2)
    try:
        call(hanging + "/_tokenize", {"mode": "hang"})
        for k in range(8):  # short prompts: each decode-only, its ids from the instance that answers
            complete(url, "/v1/completions", {"prompt": f"hello there number {k}"})
        assert verdicts(url) == {'decision="decode_only",reason="short_uncached"': 8.0}
        hung = len(call(hanging + "/_tokenize")["calls"])
        assert 1 <= hung <= 3, hung  # asked once, then again only when its back-off ends (1 s, then 2 s ...)
        failures = counts(url, "pdproxy_tokenize_failures_total")
        assert failures == {f'reason="timeout",server_address="{hanging[7:]}"': float(hung)}, failures

        # both hang: routed without token ids for a while, at no cost, and disaggregated
        call(healthy + "/_tokenize", {"mode": "hang"})
        before = len(call(hanging + "/_tokenize")["calls"]) + len(call(healthy + "/_tokenize")["calls"])
        start = time.monotonic()
        for k in range(6):
            complete(url, "/v1/completions", {"prompt": f"hello again number {k}"})
        asked = len(call(hanging + "/_tokenize")["calls"]) + len(call(healthy + "/_tokenize")["calls"]) - before
        assert asked <= 3, asked  # on the unfixed proxy: 6, each waiting out the whole budget
        assert verdicts(url)['decision="disaggregated",reason="no_token_ids"'] == 6.0
        assert time.monotonic() - start < scaled(6 * 0.5)

        # an answer that cannot be the prompt's: 3 ids for a 5,200-word prompt is not believed
        call(healthy + "/_tokenize", {"mode": "ids", "count": 3})
        call(hanging + "/_tokenize", {"mode": "ids", "count": 3})
        deadline = time.monotonic() + scaled(70)
        words = " ".join(f"word{k}" for k in range(5200))
        while not counts(url, "pdproxy_tokenize_failures_total").keys() & {
                f'reason="bad_answer",server_address="{a[7:]}"' for a in (hanging, healthy)}:
            assert time.monotonic() < deadline  # until one of them is out of its back-off and asked
            complete(url, "/v1/completions", {"prompt": words})
            time.sleep(0.2)
        assert verdicts(url)['decision="decode_only",reason="short_uncached"'] == 8.0  # no long one went decode-only
        log = procs[-1].output()
        assert "/tokenize failed (timeout" in log and "not asked for" in log and "bad_answer (3 ids" in log
    finally:
        for proc in procs:
            proc.stop()
