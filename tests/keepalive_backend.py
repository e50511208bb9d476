"""An HTTP server that closes idle keep-alive connections the way vLLM's does: uvicorn, with its idle
timeout (`--timeout-keep-alive`, 5 s on vLLM) set in seconds with a fraction.

Run: python tests/keepalive_backend.py --port N --timeout-keep-alive 0.3

Every POST is answered with a small JSON body saying which request it was and which client port it
came from, so a test sees which connection carried each request and that none was run twice.
"""

from __future__ import annotations

import argparse
import json

import uvicorn


class App:
    def __init__(self) -> None:
        self.served = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["method"] == "POST":
            self.served += 1
        body = json.dumps({"request": self.served, "peer_port": scope["client"][1]}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--timeout-keep-alive", type=float, required=True, help="seconds an idle connection is kept")
    args = parser.parse_args()
    uvicorn.run(App(), host="127.0.0.1", port=args.port, http="httptools", timeout_keep_alive=args.timeout_keep_alive,
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
