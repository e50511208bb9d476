"""One client cannot switch token-id routing off for everyone (issue 54 item 5).

A chat of tens of thousands of messages is not sent to the instances' /tokenize (it cannot be counted whole
and would hold their API servers); a timeout on an ask that is large for its kind, or one that ended late
because the proxy's own loop was held, is not charged to the instance (no back-off); a try left less than half
its share is not made. Real processes (simulated instances behind tests/tokenize_backend.py, pdproxy with
selective disaggregation, which asks /tokenize for text and chat), and RemoteTokenizer on this test's loop
against a loopback server whose answers it controls.
"""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import httpx
import pytest
from aiohttp import web

from procs import HOST
from test_routing_tokenize import call, counts, stack, verdicts
from waits import scaled

from pdproxy.policies import RequestView
from pdproxy.policies.request import MAX_KEY_PARTS
from pdproxy.routing.tokens import RemoteTokenizer

SHORT = 'decision="decode_only",reason="short_uncached"'  # a short chat whose ids came back


def chat(url: str, messages: list[dict], timeout: float = 20) -> int:
    r = httpx.post(url + "/v1/chat/completions", json={"model": "sim-model", "max_tokens": 2, "messages": messages},
                   timeout=scaled(timeout))
    return r.status_code


def test_a_clients_huge_chats_leave_everyones_token_ids_alone():
    procs, url, _, fronts = stack(2)
    try:
        huge = [{"role": "user", "content": ""}] * 60_000  # 1.9 MB, under --max-body-bytes
        stop = threading.Event()
        sent_huge: list[int] = []

        def hostile() -> None:
            while not stop.is_set():
                threading.Thread(target=lambda: sent_huge.append(chat(url, huge, 60)), daemon=True).start()
                stop.wait(0.5)

        attacker = threading.Thread(target=hostile)
        attacker.start()
        normal = 0
        try:
            deadline = time.monotonic() + scaled(20)  # a bound: a loaded 2-core machine takes ~4 s
            while normal < 10 and time.monotonic() < deadline:
                assert chat(url, [{"role": "user", "content": f"hello number {normal}"}]) == 200
                normal += 1
                time.sleep(0.1)
        finally:
            stop.set()
            attacker.join()
        assert normal == 10
        time.sleep(0.5)
        assert len(sent_huge) >= 2  # the huge chats were served (or refused) meanwhile
        asked = [len(body.get("messages", [])) for front in fronts for body in call(front + "/_tokenize")["calls"]]
        assert asked and max(asked) <= MAX_KEY_PARTS, f"a chat of {max(asked)} messages was sent to /tokenize"
        assert verdicts(url).get(SHORT) == normal  # every normal chat routed with its token ids
        assert counts(url, "pdproxy_tokenize_failures_total") == {}
    finally:
        for proc in procs:
            proc.stop()


def test_a_timeout_on_an_ask_large_for_its_kind_is_not_the_instances():
    procs, url, _, (front,) = stack(1)
    try:
        call(front + "/_tokenize", {"mode": "slow", "seconds_per_kib": 0.01})  # 1 s for a 100 KiB ask
        for k in range(5):  # the typical chat: answered at once
            assert chat(url, [{"role": "user", "content": f"hello number {k}"}]) == 200
        words = [{"role": "user", "content": " ".join(f"word{k}" for k in range(12_000))}]  # 100 KiB: times out
        chat(url, words)
        failures = counts(url, "pdproxy_tokenize_failures_total")
        assert failures == {f'reason="timeout_large_ask",server_address="{front[7:]}"': 1.0}, failures
        assert chat(url, [{"role": "user", "content": "and right after"}]) == 200  # not backed off: asked, answered
        assert verdicts(url).get(SHORT) == 6
        assert "/tokenize failed" not in procs[-1].output()  # no back-off said
    finally:
        for proc in procs:
            proc.stop()


class Targets:
    """Loopback /tokenize servers on this test's loop: each answers, hangs, or is gone, as a test sets."""

    def __init__(self) -> None:
        self.modes: dict[str, str] = {}
        self.runners: list[web.AppRunner] = []
        self.released = asyncio.Event()  # ends every hanging answer

    async def add(self, mode: str) -> tuple[str, str]:
        async def tokenize(request: web.Request) -> web.Response:
            await request.read()
            if self.modes[address] == "hang":
                await self.released.wait()
            return web.json_response({"count": 3, "max_model_len": 4096, "tokens": [1, 2, 3]})

        app = web.Application()
        app.router.add_post("/tokenize", tokenize)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, HOST, 0)
        await site.start()
        self.runners.append(runner)
        address = f"{HOST}:{site._server.sockets[0].getsockname()[1]}"
        self.modes[address] = mode
        return f"http://{address}", address

    async def close(self) -> None:
        self.released.set()
        for runner in self.runners:
            await runner.cleanup()


@pytest.mark.parametrize("held", [False, True], ids=["loop_free", "loop_held"])
def test_a_timeout_the_proxys_loop_caused_is_not_charged_and_a_starved_retry_not_made(held):
    async def scenario():
        targets = Targets()
        hanging, answering = await targets.add("hang"), await targets.add("answer")
        listed = [hanging, answering]
        counted: list[tuple[str, str]] = []
        async with aiohttp.ClientSession() as session:
            tokenizer = RemoteTokenizer(session, lambda: listed, {}, lambda a, r: counted.append((a, r)), timeout=0.5)
            tokenizer._turn = len(listed) - 1  # the hanging one is asked first
            view = RequestView({"prompt": "hello there"}, {}, chat=False)
            if held:  # a big body parsed meanwhile: the loop answers 0.4 s late
                asyncio.get_running_loop().call_later(0.05, time.sleep, 0.4)
            await tokenizer.fill(view)
            hung = tokenizer.state[hanging[1]]
            if held:
                # the timeout ended 0.2 s past its 0.25 s: the proxy's doing; no back-off, and no second try with
                # the 0.05 s left
                assert counted == [(hanging[1], "timeout_proxy_late")]
                assert hung.failures == 0 and view.token_ids is None
            else:
                assert counted == [(hanging[1], "timeout")] and hung.failures == 1  # the instance's: backed off
                assert view.token_ids == [1, 2, 3]  # the other one asked within its share
            # instances come and go: a gone one's back-off goes with it, and it comes back fresh
            listed.remove(hanging)
            await tokenizer.fill(RequestView({"prompt": "again"}, {}, chat=False))
            assert set(tokenizer.state) == {answering[1]}
            listed.append(hanging)
            await tokenizer.fill(RequestView({"prompt": "once more"}, {}, chat=False))
            assert tokenizer.state[hanging[1]].failures == 0 or tokenizer.state[hanging[1]] is not hung
        await targets.close()

    asyncio.run(scenario())
