"""A stand-in for a vLLM 0.23 instance's model handling: what it lists in /v1/models and what its model check
serves, as vLLM's source has them (entrypoints/openai: `OpenAIServing._check_model`, `_is_model_supported`,
`OpenAIServingModels.show_available_models` and `resolve_lora`).

Run: python tests/vllm_models_backend.py --port N

* `GET /v1/models`: the served names (vLLM's `--served-model-name`), each with the server's `max_model_len`, then
  the loaded LoRA adapters: `parent` the first served name, no `max_model_len` (vLLM's ModelCard leaves it None).
* The model check of `/v1/completions`, `/v1/chat/completions`, `/tokenize` and `/detokenize`: no `model`, or
  `""`, is served (by the first name); a served name or a loaded adapter is; with `skip_validation`
  (VLLM_SKIP_MODEL_NAME_VALIDATION) any name is; with a LoRA resolver (VLLM_ALLOW_RUNTIME_LORA_UPDATING and a
  resolver plugin) a name it can resolve (`resolvable`) is loaded there, on its first request, and listed from
  then on. Anything else: vLLM's 404 body.
* The length check of a generation: prompt tokens (token ids counted; text one per word; a chat one per message
  plus 3) plus `max_tokens` (`max_completion_tokens` first for chat; completions default 16) over
  `max_model_len` is vLLM's 400. Else a one-token answer, not streamed.

`POST /_serve` sets {"names", "max_model_len", "adapters", "resolvable", "skip_validation"} (an instance
restarted with other flags); `GET /_journal` lists the generations that reached it ({"path", "model"}).
"""

from __future__ import annotations

import argparse
import json

from aiohttp import web


class Instance:
    def __init__(self) -> None:
        self.names: list[str] = ["model-a"]
        self.max_model_len = 4096
        self.adapters: list[str] = []
        self.resolvable: set[str] = set()
        self.skip_validation = False
        self.journal: list[dict] = []

    def check_model(self, model: object) -> web.Response | None:
        if not model or self.skip_validation or model in self.names or model in self.adapters:
            return None
        if model in self.resolvable:  # the resolver loads it on this first request
            self.adapters.append(model)  # type: ignore[arg-type]
            return None
        return error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    def listing(self) -> dict:
        base = [{"id": name, "object": "model", "created": 1, "owned_by": "vllm", "root": "/models/m",
                 "parent": None, "max_model_len": self.max_model_len} for name in self.names]
        loras = [{"id": name, "object": "model", "created": 1, "owned_by": "vllm", "root": f"/loras/{name}",
                  "parent": self.names[0], "max_model_len": None} for name in self.adapters]
        return {"object": "list", "data": base + loras}


def error(status: int, message: str, kind: str, param: str | None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": status}},
                             status=status)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    inst = Instance()

    async def generate(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        chat = request.path.endswith("/chat/completions")
        refused = inst.check_model(body.get("model"))
        inst.journal.append({"path": request.path, "model": body.get("model")})
        if refused is not None:
            return refused
        wanted = (body.get("max_completion_tokens") or body.get("max_tokens")) if chat else body.get("max_tokens", 16)
        prompt = body.get("prompt")
        tokens = (len(body["messages"]) + 3 if chat else len(prompt) if isinstance(prompt, list)
                  else len(str(prompt).split()))
        if wanted is not None and tokens + wanted > inst.max_model_len:
            return error(400, f"This model's maximum context length is {inst.max_model_len} tokens. However, you "
                              f"requested {wanted} output tokens and your prompt contains at least {tokens} input "
                              f"tokens, for a total of at least {tokens + wanted} tokens. Please reduce the length "
                              f"of the input prompt or the number of requested output tokens. "
                              f"(parameter=input_tokens, value={tokens})", "BadRequestError", "input_tokens")
        model = body.get("model") or inst.names[0]
        choice = ({"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"} if chat
                  else {"index": 0, "text": "ok", "finish_reason": "length"})
        return web.json_response({"id": "cmpl-1", "object": "chat.completion" if chat else "text_completion",
                                  "created": 1, "model": model, "choices": [choice],
                                  "usage": {"prompt_tokens": tokens, "completion_tokens": 1,
                                            "total_tokens": tokens + 1}})

    async def detokenize(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        return inst.check_model(body.get("model")) or web.json_response({"prompt": ""})

    async def tokenize(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        return inst.check_model(body.get("model")) or web.json_response(
            {"count": 1, "max_model_len": inst.max_model_len, "tokens": [1], "token_strs": None})

    async def serve(request: web.Request) -> web.Response:
        given = await request.json()
        inst.names = given.get("names", inst.names)
        inst.max_model_len = given.get("max_model_len", inst.max_model_len)
        inst.adapters = list(given.get("adapters", []))
        inst.resolvable = set(given.get("resolvable", []))
        inst.skip_validation = bool(given.get("skip_validation", False))
        return web.json_response({"ok": True})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_get("/v1/models", lambda request: web.json_response(inst.listing()))
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", lambda request: web.Response())
    app.router.add_post("/_serve", serve)
    app.router.add_get("/_journal", lambda request: web.json_response(inst.journal))
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
