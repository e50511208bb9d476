"""`pdproxy sim` on the wire: the OpenAI/vLLM request and response formats, run as a real process."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from pdproxy.sim.probe import Timed, metric_samples, metric_value, timed_request
from pdproxy.sim.tokens import BOS, END_HEADER, EOT, START_HEADER, Tokenizer
from procs import start_sim

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def instant():
    """Fast answers, vLLM's optional response extras switched on, vLLM-like max-model-len."""
    proc, url = start_sim("single", "--preset", "instant", "--max-model-len", "4608", "--enable-per-request-metrics",
                          "--enable-request-id-headers", "--eos-after-tokens", "20")
    try:
        yield url
    finally:
        assert proc.stop() == 0, proc.output()


@pytest.fixture(scope="module")
def timed():
    """The default calibrated preset."""
    proc, url = start_sim("single", "--enable-per-request-metrics")
    try:
        yield url
    finally:
        assert proc.stop() == 0, proc.output()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def post(url: str, body: Any, headers: dict[str, str] | None = None, raw: bytes | None = None
               ) -> tuple[int, CIMultiDict[str], Any]:
    async with aiohttp.ClientSession() as s:
        kwargs = {"data": raw} if raw is not None else {"json": body}
        async with s.post(url, headers=headers, **kwargs) as r:
            text = await r.text()
            try:
                return r.status, CIMultiDict(r.headers), json.loads(text)
            except ValueError:
                return r.status, CIMultiDict(r.headers), text


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s:
        async with s.get(url) as r:
            return r.status, await r.text()


async def request(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Timed:
    async with aiohttp.ClientSession() as s:
        return await timed_request(s, url, body, headers, keep_events=True)


def words(n: int) -> str:
    return " ".join(f"w{i}" for i in range(n))


TOK = Tokenizer(2.3)  # the sims' default rule


def prompt_tokens(text: str) -> int:
    """A text completion prompt's tokens: BOS + the rule's tokens."""
    return 1 + TOK.count(text)


# ---- plain endpoints --------------------------------------------------------------------------
def test_health_models_and_metrics_names(instant):
    status, body = run(get(instant + "/health"))
    assert status == 200
    status, body = run(get(instant + "/v1/models"))
    models = json.loads(body)
    assert status == 200 and models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["sim-model"] and models["data"][0]["max_model_len"] == 4608
    run(post(instant + "/v1/completions", {"prompt": "a b c", "max_tokens": 2}))
    status, text = run(get(instant + "/metrics"))
    assert status == 200
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
                 "vllm:request_prefill_time_seconds_bucket", "vllm:request_decode_time_seconds_bucket",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:nixl_xfer_time_seconds_bucket", "vllm:nixl_bytes_transferred_bucket",
                 "vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_kv_expired_reqs_total"):
        samples = metric_samples(text, name)
        assert samples, name
        assert all(lbl.get("model_name") == "sim-model" and lbl.get("engine") == "0" for lbl, _ in samples), name
    ttft_buckets = [lbl["le"] for lbl, _ in metric_samples(text, "vllm:time_to_first_token_seconds_bucket")]
    assert ttft_buckets[:4] == ["0.001", "0.005", "0.01", "0.02"] and ttft_buckets[-2:] == ["2560.0", "+Inf"]
    assert metric_value(text, "vllm:request_success_total", finished_reason="length") >= 1
    assert metric_value(text, "vllm:prompt_tokens_total") >= 3


# ---- non-streaming ------------------------------------------------------------------------------
def test_completion_ids_usage_and_deterministic_text(instant):
    body = {"model": "sim-model", "prompt": words(7), "max_tokens": 5}
    status, headers, out = run(post(instant + "/v1/completions", body, {"X-Request-Id": "abc-123"}))
    assert status == 200, out
    assert out["id"] == "cmpl-abc-123" and out["object"] == "text_completion" and out["model"] == "sim-model"
    assert headers["X-Request-Id"] == "abc-123"
    n = prompt_tokens(words(7))
    assert n > 8  # words are sub-word tokens, not one each
    assert out["usage"] == {"prompt_tokens": n, "completion_tokens": 5, "total_tokens": n + 5,
                            "prompt_tokens_details": None}
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"].strip()
    assert out["kv_transfer_params"] is None
    m = out["metrics"]
    assert set(m) >= {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms",
                      "tokens_per_second"}
    # same request, same words; another prompt, other words; no header -> random hex id
    _, _, again = run(post(instant + "/v1/completions", body))
    assert again["choices"][0]["text"] == choice["text"]
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", again["id"])
    _, _, third = run(post(instant + "/v1/completions", body))
    assert third["id"] != again["id"]
    _, _, other = run(post(instant + "/v1/completions", dict(body, prompt=words(8))))
    assert other["choices"][0]["text"] != choice["text"]


def test_token_id_prompts_and_defaults(instant):
    _, _, out = run(post(instant + "/v1/completions", {"prompt": list(range(100, 133)), "max_tokens": 3}))
    assert out["usage"]["prompt_tokens"] == 33 and out["usage"]["completion_tokens"] == 3
    _, _, batch_of_one = run(post(instant + "/v1/completions", {"prompt": [list(range(10))], "max_tokens": 1}))
    assert batch_of_one["usage"]["prompt_tokens"] == 10
    # no model field is fine; completions default to 16 tokens like vLLM (eos disabled by ignore_eos)
    status, _, out = run(post(instant + "/v1/completions", {"prompt": "x y", "ignore_eos": True}))
    assert status == 200 and out["usage"]["completion_tokens"] == 16


def test_chat_counts_message_overhead_and_max_completion_tokens(instant):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "one two three"},
                                             {"type": "image_url", "image_url": {"url": "x"}}]}]
    status, _, out = run(post(instant + "/v1/chat/completions",
                              {"messages": messages, "max_tokens": 9, "max_completion_tokens": 4},
                              {"X-Request-Id": "chat-1"}))
    assert status == 200, out
    assert out["id"] == "chatcmpl-chat-1" and out["object"] == "chat.completion"
    # the template: BOS, per message header + content + eot, then the assistant's header
    assert out["usage"]["prompt_tokens"] == len(TOK.encode_chat(messages)) > 2 * 4 + TOK.count("be brief one two three")
    assert out["usage"]["completion_tokens"] == 4
    msg = out["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"].strip()
    _, _, counted = run(post(instant + "/tokenize", {"messages": messages}))
    assert counted["count"] == out["usage"]["prompt_tokens"]


def test_eos_min_tokens_and_ignore_eos(instant):
    # this sim is started with --eos-after-tokens 20
    _, _, out = run(post(instant + "/v1/completions", {"prompt": "a", "max_tokens": 50}))
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 20
    _, _, out = run(post(instant + "/v1/completions", {"prompt": "a", "max_tokens": 50, "min_tokens": 30}))
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 30
    _, _, out = run(post(instant + "/v1/completions", {"prompt": "a", "max_tokens": 50, "ignore_eos": True}))
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 50


# ---- streaming ------------------------------------------------------------------------------------
def test_completion_stream_chunks_finish_and_done(instant):
    t = run(request(instant + "/v1/completions", {"prompt": words(4), "max_tokens": 6, "stream": True},
                    {"X-Request-Id": "s1"}))
    assert t.ok and t.done, t.error
    assert all(e["id"] == "cmpl-s1" and e["object"] == "text_completion" for e in t.events)
    assert len(t.events) == 6 and all("usage" not in e for e in t.events)  # no usage chunk unless asked
    assert [e["choices"][0]["finish_reason"] for e in t.events] == [None] * 5 + ["length"]
    assert t.events[-1]["choices"][0]["text"].strip()  # the last token rides on the finish chunk


def test_completion_stream_usage_and_metrics(instant):
    t = run(request(instant + "/v1/completions", {"prompt": words(4), "max_tokens": 6, "stream": True,
                                                  "stream_options": {"include_usage": True}}))
    assert t.ok and t.done
    last = t.events[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6 and last["usage"]["prompt_tokens"] == prompt_tokens(words(4))
    assert "metrics" in last and "mean_itl_ms" in last["metrics"]
    assert all("usage" not in e for e in t.events[:-1])


def test_continuous_usage_stats(instant):
    t = run(request(instant + "/v1/completions", {"prompt": words(3), "max_tokens": 5, "stream": True,
                                                  "stream_options": {"include_usage": True,
                                                                     "continuous_usage_stats": True}}))
    assert t.ok
    counts = [e["usage"]["completion_tokens"] for e in t.events]
    assert counts == [1, 2, 3, 4, 5, 5]  # every chunk, then the final usage chunk
    assert all(e["usage"]["prompt_tokens"] == prompt_tokens(words(3)) for e in t.events)


def test_chat_stream_role_chunk_then_content(instant):
    t = run(request(instant + "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3, "stream": True,
                     "stream_options": {"include_usage": True}}, {"X-Request-Id": "c9"}))
    assert t.ok and t.done
    ev = t.events
    assert all(e["id"] == "chatcmpl-c9" and e["object"] == "chat.completion.chunk" for e in ev)
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert ev[0]["choices"][0]["finish_reason"] is None
    content = [e for e in ev[1:] if e["choices"]]
    assert len(content) == 3 and all(e["choices"][0]["delta"]["content"].strip() for e in content)
    assert [e["choices"][0]["finish_reason"] for e in content] == [None, None, "length"]
    assert ev[-1]["choices"] == [] and ev[-1]["usage"]["completion_tokens"] == 3
    # streamed text equals the non-streamed text of the same request
    _, _, whole = run(post(instant + "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3}))
    assert "".join(e["choices"][0]["delta"]["content"] for e in content) == whole["choices"][0]["message"]["content"]


def test_stream_interval_groups_tokens():
    proc, url = start_sim("single", "--preset", "instant", "--stream-interval", "4")
    try:
        t = run(request(url + "/v1/completions", {"prompt": "a b", "max_tokens": 10, "stream": True,
                                                  "stream_options": {"include_usage": True,
                                                                     "continuous_usage_stats": True}}))
    finally:
        proc.stop()
    assert t.ok
    assert [e["usage"]["completion_tokens"] for e in t.events if e["choices"]] == [4, 8, 10]


def test_timed_stream_paces_tokens_and_reports_metrics(timed):
    t = run(request(timed + "/v1/completions", {"prompt": words(64), "max_tokens": 20, "stream": True,
                                                "stream_options": {"include_usage": True}}))
    assert t.ok and t.chunk_tokens[-1] == 20
    itl = t.per_token_itl
    assert itl is not None and 0.003 < itl < 0.02  # one decode step per token: ~5 ms, not instant
    assert t.ttft is not None and t.ttft > 0.008  # front end + one prefill step
    m = t.metrics
    assert m["generation_time_ms"] > 19 * 3 and 3 < m["mean_itl_ms"] < 20 and m["tokens_per_second"] > 0


# ---- errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, status, fragment", [
    ({"model": "other", "prompt": "a"}, 404, "does not exist"),
    ({"prompt": "a", "n": 2}, 400, "n"),
    ({"prompt": "a", "max_tokens": 5, "min_tokens": 6}, 400, "min_tokens"),
    ({"prompt": "a", "max_tokens": "five"}, 400, "max_tokens"),
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "a", "stream": "yes"}, 400, "stream"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream=True"),
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": [1, 2, 10 ** 9]}, 400, "vocabulary"),
    ({"prompt": [1, "x"]}, 400, "token ids"),
    ({"prompt": ["a", "b"]}, 400, "batched"),
    ({}, 400, "prompt"),
    ({"prompt": words(4600), "max_tokens": 10}, 400, "maximum context length is 4608"),
    ({"prompt": "a", "kv_transfer_params": "x"}, 400, "kv_transfer_params"),
])
def test_invalid_completion_requests_get_openai_errors(instant, body, status, fragment):
    code, _, out = run(post(instant + "/v1/completions", body))
    assert code == status, out
    err = out["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert fragment in err["message"]
    assert err["type"] == ("NotFoundError" if status == 404 else "BadRequestError")


def test_invalid_json_and_chat_messages(instant):
    code, _, out = run(post(instant + "/v1/completions", None, raw=b"{not json"))
    assert code == 400 and "JSON" in out["error"]["message"]
    code, _, out = run(post(instant + "/v1/chat/completions", {"messages": []}))
    assert code == 400 and "messages" in out["error"]["message"]
    code, _, out = run(post(instant + "/v1/chat/completions", {"messages": [{"content": "no role"}]}))
    assert code == 400 and "role" in out["error"]["message"]
    code, _, out = run(post(instant + "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                                               "max_tokens": 4605}))
    assert code == 400 and "maximum context length" in out["error"]["message"]


# ---- tokenizer endpoints (vLLM 0.23's shapes, research/vllm023-api-shapes.md) -------------------
def test_tokenize_prompt_and_messages_and_detokenize_round_trip(instant):
    text = "Sub-word tokens: pseudo words like bakodu tell more than one ✓"
    status, _, out = run(post(instant + "/tokenize", {"model": "sim-model", "prompt": text}))
    assert status == 200 and set(out) == {"count", "max_model_len", "tokens", "token_strs"}
    assert out["max_model_len"] == 4608 and out["token_strs"] is None
    assert out["tokens"][0] == BOS and out["count"] == len(out["tokens"]) > len(text.split()) + 1
    _, _, plain = run(post(instant + "/tokenize", {"prompt": text, "add_special_tokens": False,
                                                  "return_token_strs": True}))
    assert plain["tokens"] == out["tokens"][1:] and "".join(plain["token_strs"]).startswith("Sub")
    _, _, back = run(post(instant + "/detokenize", {"tokens": plain["tokens"]}))
    assert back == {"prompt": text}
    # the count the generation endpoint charges is the count /tokenize gives
    _, _, done = run(post(instant + "/v1/completions", {"prompt": text, "max_tokens": 1}))
    assert done["usage"]["prompt_tokens"] == out["count"]
    messages = [{"role": "user", "content": "hi there"}]
    _, _, chat = run(post(instant + "/tokenize", {"messages": messages}))
    ids = chat["tokens"]
    assert ids[:2] == [BOS, START_HEADER] and EOT in ids and ids.count(START_HEADER) == 2  # + the generation prompt
    _, _, no_prompt = run(post(instant + "/tokenize", {"messages": messages, "add_generation_prompt": False}))
    assert no_prompt["tokens"] == ids[:ids.index(EOT) + 1]
    _, _, header = run(post(instant + "/detokenize", {"tokens": ids[:ids.index(END_HEADER) + 1]}))
    assert header["prompt"] == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>"


@pytest.mark.parametrize("path, body, status, fragment", [
    ("/tokenize", {"model": "other", "prompt": "a"}, 404, "does not exist"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", [1], 400, "JSON object"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, 400, "vocabulary"),
    ("/detokenize", {"tokens": "12"}, 400, "tokens"),
])
def test_tokenizer_endpoints_reject_bad_bodies(instant, path, body, status, fragment):
    code, _, out = run(post(instant + path, body))
    assert code == status and fragment in out["error"]["message"], out


def test_over_long_request_gets_vllms_400_body(instant):
    _, _, counted = run(post(instant + "/tokenize", {"prompt": words(1500)}))
    n = counted["count"]
    over = 4608 - n + 1
    code, _, out = run(post(instant + "/v1/completions", {"prompt": words(1500), "max_tokens": over}))
    assert code == 400
    assert out["error"] == {
        "message": f"This model's maximum context length is 4608 tokens. However, you requested {over} output "
                   f"tokens and your prompt contains at least {n} input tokens, for a total of at least 4609 "
                   "tokens. Please reduce the length of the input prompt or the number of requested output "
                   f"tokens. (parameter=input_tokens, value={n})",
        "type": "BadRequestError", "param": "input_tokens", "code": 400}
    code, _, _ = run(post(instant + "/v1/completions", {"prompt": words(1500), "max_tokens": over - 1,
                                                        "min_tokens": over - 1, "ignore_eos": True}))
    assert code == 200


def test_tokens_per_word_flag_sets_the_rule():
    proc, url = start_sim("single", "--preset", "instant", "--tokens-per-word", "1")
    try:
        _, _, one = run(post(url + "/tokenize", {"prompt": words(7), "add_special_tokens": False}))
    finally:
        proc.stop()
    assert one["count"] == 7  # "w0".."w6": one token each at a mean of 1


# ---- control endpoints ------------------------------------------------------------------------------
def test_request_journal_records_and_clears(instant):
    assert run(post(instant + "/sim/requests", None, raw=b""))[0] == 405
    async def scenario() -> dict[str, Any]:
        async with aiohttp.ClientSession() as s:
            async with s.delete(instant + "/sim/requests") as r:
                assert r.status == 200
            await s.post(instant + "/v1/completions", json={"prompt": "a b", "max_tokens": 1},
                         headers={"X-Request-Id": "j1", "Traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
            await s.post(instant + "/v1/chat/completions", data=b"{broken")
            async with s.get(instant + "/sim/requests") as r:
                journal = await r.json()
            async with s.delete(instant + "/sim/requests") as r:
                assert r.status == 200
            async with s.get(instant + "/sim/requests") as r:
                assert (await r.json())["requests"] == []
            return journal
    journal = run(scenario())["requests"]
    assert len(journal) == 2
    first, second = journal
    assert first["method"] == "POST" and first["path"] == "/v1/completions"
    assert first["headers"]["x-request-id"] == "j1" and first["headers"]["traceparent"].startswith("00-111")
    assert first["body"] == {"prompt": "a b", "max_tokens": 1}
    assert isinstance(first["received_at"], float) and first["received_at"] <= second["received_at"]
    assert second["path"] == "/v1/chat/completions" and second["body"] is None


def test_state_reports_engine_stats(timed):
    status, text = run(get(timed + "/sim/state"))
    state = json.loads(text)
    assert status == 200
    for key in ("running", "waiting", "kv_blocks_used", "kv_blocks_free", "leases_held", "transfers_queued"):
        assert key in state, key
    assert state["role"] == "single" and state["preset"] == "h200-llama8b" and state["kv_blocks_total"] == 50000


def test_single_ignores_kv_transfer_params(instant):
    _, _, out = run(post(instant + "/v1/completions", {"prompt": "a b c", "max_tokens": 3,
                                                       "kv_transfer_params": {"do_remote_decode": True}}))
    assert out["kv_transfer_params"] is None and out["usage"]["completion_tokens"] == 3
