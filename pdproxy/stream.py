"""Relaying a decode response to the client while timing its tokens.

The bytes go to the client exactly as the instance sent them (`WholeEventWriter` only holds back a
partial event until it is whole); the scanner only reads them to
learn when each token-bearing event arrived, how many tokens it carried (when the stream reports
`usage` on every chunk) and what the response said about itself (id, usage, finish reasons,
vLLM's per-request `metrics`, an in-band error).

Speed: a stream's events differ, most of the time, only in their text: "one choice, this text". The
first such event (a completion's first; a chat stream's second, after its role-only delta) is parsed
(orjson) and its bytes before and after the text kept as the stream's head and tail, once a second
parse has shown that the text is all they leave open; every later event with that head and tail is
then read by comparing them and looking at the text's bytes (a tenth of a parse and its bookkeeping:
some 12 k instructions an event under callgrind). The others (the closing ones: finish reason, final
usage, `[DONE]`; usage on every event; anything unusual) are parsed. `ResponseScan(fast=False)` is the
reference that always parses; the tests check that both agree.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import Any

from pdproxy import jsonio
from pdproxy.errors import DECODE, ProxyError
from pdproxy.serving.exchange import Exchange
from pdproxy.upstream import Response, UpstreamError

_DATA = b"data: {"
_LAST_DONE = b"\n\ndata: [DONE]\n\n"
# A single byte is looked for as an int (`CR in data`): `b"\r" in data` first tries its needle as an int, and the
# TypeError raised and cleared costs ~3.5 k instructions on Python 3.12 under callgrind, ten times the search
CR, LF, _BACKSLASH = ord("\r"), ord("\n"), ord("\\")
MAX_EVENT_BYTES = 16 * 1024 * 1024  # as migration.MAX_HEAD_BYTES: room for a 2M-token prompt's ids
DONE_GRACE = 1.0  # seconds the end of a body may take after its [DONE] (vLLM: at once)
# A JSON string's content: what may stand between a plain event's head and tail (`_json_text`)
_JSON_TEXT = re.compile(rb'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')


class ClientGone(Exception):
    """The client closed its connection while we were writing to it."""


class ResponseScan:
    """What the proxy learns from one response, streamed or not."""

    def __init__(self, chat: bool, fast: bool = True) -> None:
        self.chat = chat
        self.fast = fast
        self.chunk_times: list[int] = []  # monotonic ns of each token-bearing event
        self.chunk_tokens: list[int] = []  # tokens each carried; 0 when the stream did not say
        self.response_id: str | None = None
        self.response_model: str | None = None  # the answer's `model`: a name the instance serves
        self.finish_reasons: list[str] = []
        self.server_metrics: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None
        self.done = False  # saw `data: [DONE]`
        self.malformed = 0
        self._buffer = b""
        self._completion_tokens = 0
        self._text_key = b'"content":"' if chat else b'"text":"'
        # the bytes of this stream's plain events before and after their text (`_adopt`): None until known
        self._head: bytes | None = None
        self._tail = b""

    @property
    def first_token_ns(self) -> int | None:
        return self.chunk_times[0] if self.chunk_times else None

    # -- streamed responses -------------------------------------------------------------

    def feed(self, data: bytes, now_ns: int) -> None:
        buffer = self._buffer + data if self._buffer else data
        if CR in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        cut = buffer.rfind(b"\n\n")
        if cut < 0:
            self._buffer = buffer
            return
        self._buffer = buffer[cut + 2:]
        for event in buffer[:cut].split(b"\n\n"):
            # a chat stream's first event (its id) is a role-only delta, whose head and tail no later one has
            if not (self.fast and (self.response_id is not None or not self.chat) and self._plain(event, now_ns)):
                self._event(event, now_ns)

    def _plain(self, event: bytes, now_ns: int) -> bool:
        """Record `event` by its bytes when it has the stream's head and tail, else parse and record it
        here until a head and tail are adopted (`_adopt`); False: `_event` reads it."""
        if self._head is not None:
            return self._templated(event, self._head, now_ns)
        return self._adopt(event, now_ns)

    def _templated(self, event: bytes, head: bytes, now_ns: int) -> bool:
        """`event` is this stream's head, a JSON string's content and its tail: the parse would read the
        adopted event with another text (a token when it is not empty)."""
        tail = self._tail
        end = len(event) - len(tail)
        if end < len(head) or not event.startswith(head) or not event.endswith(tail):
            return False
        if end > len(head):
            if not _json_text(event[len(head):end]):
                return False
            self.chunk_times.append(now_ns)
            self.chunk_tokens.append(0)
        return True

    def _adopt(self, event: bytes, now_ns: int) -> bool:
        """Parse and record a single-line event (False: `_event` reads it); keep the bytes around its text as
        the stream's head and tail when a second parse, of the event with another text, says that the
        text is all they leave open, and the event says nothing else: one choice, no finish reason, usage,
        metrics or error, and no output besides the text (for chat: no reasoning or tool calls)."""
        if not event.startswith(_DATA) or LF in event:
            return False
        try:
            obj = jsonio.loads(event[6:])
        except ValueError:
            return False
        if not isinstance(obj, dict):
            return False
        self._observe(obj, now_ns, streamed=True)
        choices = obj.get("choices")
        if (not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict)
                or isinstance(obj.get("error"), dict) or isinstance(obj.get("usage"), dict)
                or isinstance(obj.get("metrics"), dict) or choices[0].get("finish_reason")):
            return True
        start = event.find(self._text_key) + len(self._text_key)
        end = event.find(b'"', start)
        if start < len(self._text_key) or end < 0 or _BACKSLASH in event[start:end]:
            return True
        choice = choices[0]
        part = choice.get("delta") if self.chat else choice
        key = "content" if self.chat else "text"
        if not isinstance(part, dict) or self._has_output(_with_text(self.chat, choice, part, key, ""), streamed=True):
            return True
        try:
            probe = jsonio.loads(event[6:start] + b"\\u0000" + event[end:])
        except ValueError:
            return True
        if probe == {**obj, "choices": [_with_text(self.chat, choice, part, key, "\x00")]}:
            self._head, self._tail = event[:start], event[end:]
        return True

    def _event(self, event: bytes, now_ns: int) -> None:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue  # comments (`:`), `event:` and `id:` lines carry no tokens
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            try:
                obj = jsonio.loads(payload)
            except ValueError:
                self.malformed += 1
                continue
            if isinstance(obj, dict):
                self._observe(obj, now_ns, streamed=True)
            else:
                self.malformed += 1

    # -- whole responses ----------------------------------------------------------------

    def feed_whole(self, body: bytes, now_ns: int) -> None:
        try:
            obj = jsonio.loads(body)
        except ValueError:
            self.malformed += 1
            return
        if isinstance(obj, dict):
            self._observe(obj, now_ns, streamed=False)

    # -- shared ------------------------------------------------------------------------

    def _observe(self, obj: dict[str, Any], now_ns: int, streamed: bool) -> None:
        if "error" in obj and isinstance(obj["error"], dict):
            self.error = obj["error"]
            return
        if self.response_id is None and isinstance(obj.get("id"), str):
            self.response_id = obj["id"]
            if isinstance(obj.get("model"), str):
                self.response_model = obj["model"]
        bearing = False
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason"):
                self.finish_reasons.append(str(choice["finish_reason"]))
            if self._has_output(choice, streamed):
                bearing = True
        usage = obj.get("usage")
        tokens = 0
        if isinstance(usage, dict):
            self.usage = usage
            completion = usage.get("completion_tokens")
            if isinstance(completion, int) and completion > self._completion_tokens:
                tokens = completion - self._completion_tokens
                self._completion_tokens = completion
                # a choice whose token text the detokenizer still holds back is a token all the same;
                # the trailing usage-only event (no choices) is not
                bearing = bearing or (streamed and bool(obj.get("choices")))
        if isinstance(obj.get("metrics"), dict):
            self.server_metrics = obj["metrics"]
        if bearing or (not streamed and obj.get("choices")):
            self.chunk_times.append(now_ns)
            self.chunk_tokens.append(tokens)

    def _has_output(self, choice: dict[str, Any], streamed: bool) -> bool:
        if not self.chat:
            return bool(choice.get("text"))
        part = choice.get("delta") if streamed else choice.get("message")
        if not isinstance(part, dict):
            return False
        # the role-only opening delta of a chat stream is not a token
        return bool(part.get("content") or part.get("reasoning_content") or part.get("reasoning") or part.get("tool_calls"))


async def relay(upstream: Response, downstream: WholeEventWriter | None, scan: ResponseScan,
                tap: Any = None) -> None:
    """Copy the upstream stream to the client (or nowhere, for shadow traffic), timing it on the way;
    through `tap` (`migration.TokenTap`) first when the stream is armed for mid-stream migration.

    Upstream failures, including a stream that ends without `[DONE]`, surface as
    `ProxyError(stage=decode)`; a client that went away as `ClientGone`. The stream ends at `[DONE]`:
    nothing after it reaches the client, and a connection that breaks after it broke nothing.
    """
    clock = time.monotonic_ns
    partial = 0  # bytes of the event in progress: held by the scanner, the tap and the client's writer
    sink = Pipe(downstream, scan, upstream).take if downstream is not None and tap is None else None
    while not scan.done:
        try:
            upstream.sink = sink  # while this waits: plain events go straight through
            data = await upstream.readany()
        except (TimeoutError, UpstreamError) as exc:
            raise stream_failure(exc, "mid-stream") from None
        finally:
            upstream.sink = None  # what this holds goes first: nothing may overtake it
        if not data:
            break
        tail = _after_last_event(data)
        partial = partial + len(data) if tail is None else tail
        if partial > MAX_EVENT_BYTES:
            raise ProxyError(502, f"decode instance sent an event longer than {MAX_EVENT_BYTES} bytes",
                             error_type="malformed_stream", stage=DECODE)
        if tap is not None:
            data = tap.feed(data)
        scan.feed(data, clock())
        if scan.done:
            data = through_done(data)
        if downstream is not None and data:
            try:  # the end of the client's response once the instance's has come: its connection is reusable now
                await downstream.write(data, end=scan.done and upstream.at_eof)
            except ConnectionError:
                raise ClientGone() from None
    if scan.done:
        await _drain(upstream)
    elif scan.error is None:
        raise ProxyError(502, "decode instance ended the stream without [DONE]", error_type="stream_truncated",
                         stage=DECODE)


async def _drain(upstream: Response) -> None:
    """Read the body's end after `[DONE]` (what may follow is dropped), so that its connection can be
    reused; an instance that sends on or holds the connection open gets DONE_GRACE seconds, then it is closed."""
    if upstream.at_eof:
        return  # the usual case: the body's end came with the [DONE]; no timer to arm
    try:
        async with asyncio.timeout(DONE_GRACE):
            while await upstream.readany():
                pass
    except (TimeoutError, UpstreamError):
        pass


def _after_last_event(data: bytes) -> int | None:
    """How many bytes of `data` follow its last complete event; None: no event ends in it."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    if lf < 0 and crlf < 0:
        return None
    return len(data) - max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def through_done(data: bytes) -> bytes:
    """`data` up to the end of its `[DONE]` event: nothing after it is the client's. (CRLF framing,
    rare, and a `[DONE]` split across reads are passed as they came.)"""
    if CR in data or data.endswith(_LAST_DONE) and data.count(b"[DONE]") == 1:
        return data  # the usual read: [DONE] is its last event, and its only one
    events = data.split(b"\n\n")
    for i, event in enumerate(events[:-1]):
        if any(line[5:].strip() == b"[DONE]" for line in event.split(b"\n") if line.startswith(b"data:")):
            return b"\n\n".join(events[:i + 1]) + b"\n\n"
    return data


def stream_failure(exc: BaseException, when: str) -> ProxyError:
    """A transport failure reading a decode's stream (`Response.readany`) as the `ProxyError(stage=decode)`
    it is, saying `when` it happened. (Read in place, not through a helper coroutine: one layer less
    resumed at every read.)"""
    if isinstance(exc, TimeoutError):  # the upstream client's read timeout
        return ProxyError(504, f"decode instance went silent {when} (read timeout)", error_type="timeout",
                          stage=DECODE)
    return ProxyError(502, f"decode instance broke the stream {when}: {exc.__class__.__name__}",
                      error_type="stream_broken", stage=DECODE)


class Pipe:
    """The relay's fast path: a read of whole, plain events goes from the instance's connection to the
    client's without waking the relay's task, scanned on arrival.

    Per event that spares a future, a task wake-up and the resumption of every coroutine of the request
    (at 256 streams, most of the loop's turns). What a stream's reads bring within one turn of the loop
    goes out in one write at its end (one callback, not one write per read: under load the relay's
    task gave that for free by waking late). Only what needs nothing else is taken: whole events
    (nothing held back), no CR, no `[DONE]` or `"error"` (the stream's end and in-band errors are the
    relay's), within the event size bound, a client that takes bytes now (`Exchange.writable`: not one
    whose socket is full, nor aiohttp's responses). Anything else waits for the relay, which runs after
    the pending write (both are the loop's callbacks, in order). A malformed event is answered as the
    relay would: the events before it go out, and the relay gets the error."""

    __slots__ = ("writer", "scan", "upstream", "pending")

    def __init__(self, writer: WholeEventWriter, scan: ResponseScan, upstream: Response) -> None:
        self.writer = writer
        self.scan = scan
        self.upstream = upstream
        self.pending: list[bytes] = []  # taken, to be written at the end of this turn of the loop

    def take(self, data: bytes) -> bool:
        writer, scan = self.writer, self.scan
        if (writer.held or not data.endswith(b"\n\n") or CR in data or data.find(b"[DONE]") >= 0
                or data.find(b'"error"') >= 0 or len(data) > MAX_EVENT_BYTES or not writer.client.writable):
            return False
        scan.feed(data, time.monotonic_ns())
        if scan.malformed > writer.malformed:
            self.flush()
            writer.client.write_now(_events_before_malformed(data))
            self.upstream.interrupt(_malformed())  # the relay raises it
        else:
            if not self.pending:  # the first this turn: the write at its end
                asyncio.get_running_loop().call_soon(self.flush)
            self.pending.append(data)
        return True

    def flush(self) -> None:
        pending = self.pending
        if pending:
            self.pending = []
            self.writer.client.write_now(pending[0] if len(pending) == 1 else b"".join(pending))


class WholeEventWriter:
    """The client's end of the relay: it gets whole SSE events only, and none past a malformed one.

    The status line goes out with the first write, which the proxy makes only once the decode sent its
    first token (`migration.read_head`): a decode that fails before it (breaks, goes silent, ends at
    once) is retried elsewhere, or gives the client an HTTP error status rather than a 200 carrying
    an error event. `relay` feeds each read to the scanner
    before writing it here, so a read that brought a malformed event (a `data:` line that is not a
    JSON object) is refused whole and the stream ends with an error event instead: a client's SSE
    parser would otherwise choke on the broken line, or on our error event glued to its half.
    """

    def __init__(self, client: Exchange, scan: Any, on_delivered: Callable[[], None] = lambda: None,
                 on_cut_off: Callable[[], None] = lambda: None) -> None:
        self.client = client  # its answer begun (`Exchange.start`): the head goes out with the first write
        self.scan = scan
        self.on_delivered = on_delivered  # called once `[DONE]` has been written to the client
        self.on_cut_off = on_cut_off
        self.malformed = scan.malformed
        self.held = b""  # bytes after the last complete event, waiting for the rest of it
        self.write_started = 0.0  # monotonic time of the write in progress, 0 when none (see SlowReaders)

    async def write(self, data: bytes, end: bool = False) -> None:
        """Send the whole events of what came so far. `end`: nothing follows `data`, so nothing is held
        back and the response ends with it (one write instead of two)."""
        malformed = self.scan.malformed > self.malformed
        if malformed:
            data = _events_before_malformed(self.held + data)  # rare: worth a parse to keep what was fine
            self.held = b""
        else:
            if self.held:
                data, self.held = self.held + data, b""
            if not end and CR not in data:  # CRLF framing is passed through as it comes
                cut = data.rfind(b"\n\n")
                whole = cut + 2 if cut >= 0 else 0
                if whole < len(data):
                    data, self.held = data[:whole], data[whole:]
        if data:
            self.write_started = time.monotonic()
            await self.client.send(data, end=end and not malformed)  # waits while the client's socket is full
            self.write_started = 0.0
            if self.scan.done and not self.held:
                self.on_delivered()
        if malformed:
            raise _malformed()

    async def flush(self) -> None:
        if self.held:
            await self.write(b"", end=True)

    def cut_off(self) -> None:
        """Drop a client that stopped reading: its blocked write fails and the decode is aborted."""
        self.on_cut_off()  # before the abort, which cancels the handler
        self.client.abort()


class SlowReaders:
    """Cuts off clients that leave streamed data unread for longer than `timeout` seconds.

    Without it a client that stops reading holds its decode (and the KV blocks behind it) for as
    long as it keeps the connection open. One sweeper for all streams keeps the per-event cost to
    a clock read, instead of a timer armed around every write.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.writers: set[WholeEventWriter] = set()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._sweep(), name="slow-reader-sweeper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.timeout / 4))
            deadline = time.monotonic() - self.timeout
            for writer in [w for w in self.writers if 0.0 < w.write_started < deadline]:
                writer.cut_off()


def _with_text(chat: bool, choice: dict[str, Any], part: dict[str, Any], key: str, text: str) -> dict[str, Any]:
    """`choice` with its text (a chat delta's content) replaced."""
    return {**choice, "delta": {**part, key: text}} if chat else {**part, key: text}


def _json_text(text: bytes) -> bool:
    """Whether `text` is a JSON string's content as the readers take it. A token's few bytes are looked
    at one by one (no call); only one with an escape goes to the pattern."""
    plain_ascii = True
    for c in text:
        if c < 0x20 or c == 0x22:  # a control character or a quote: not inside a string
            return False
        if c == 0x5C:
            return _JSON_TEXT.fullmatch(text) is not None and (text.isascii() or _utf8(text))
        if c >= 0x80:
            plain_ascii = False
    return plain_ascii or _utf8(text)


def _utf8(text: bytes) -> bool:
    """Whether the readers take `text` (the exact one reads lone surrogates too)."""
    try:
        text.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return False
    return True


def _malformed() -> ProxyError:
    return ProxyError(502, "decode instance sent a malformed stream event (not a JSON object)",
                      error_type="malformed_stream", stage=DECODE)


def _events_before_malformed(data: bytes) -> bytes:
    """The whole SSE events in `data` that come before the first `data:` line that is not a JSON object."""
    out: list[bytes] = []
    for event in data.split(b"\n\n")[:-1]:
        for line in event.split(b"\n"):
            payload = line[5:].strip() if line.startswith(b"data:") else None
            if payload is None or payload == b"[DONE]":
                continue
            try:
                ok = isinstance(jsonio.loads(payload), dict)
            except ValueError:
                ok = False
            if not ok:
                return b"".join(out)
        out.append(event + b"\n\n")
    return b"".join(out)
