"""`finetune serve`: an OpenAI-compatible HTTP server for a base model and its LoRA adapters.

    finetune serve --model_name_or_path BASE                                     # http://127.0.0.1:8000/v1
    finetune serve --model_name_or_path BASE --adapter orders=outputs/run/model --adapter chat=outputs/chat/model
    finetune serve ... --load_in_4bit | --load_in_8bit | --device_map auto --max_memory cpu=2GiB,disk=20GiB
    finetune serve ... --api_key SECRET --host 0.0.0.0 --port 8080

Routes: GET /v1/models, POST /v1/chat/completions (the model's chat template and stop tokens; `"stream": true`
streams server-sent events), POST /v1/completions (plain text). The request's `model` picks the base (its folder's
name, or --served_model_name) or an adapter (its NAME). Decoding is greedy unless the request gives a temperature
above 0: the tokens equal transformers' own `generate` on the same rendering. A sampled request with a `seed` gets
the tokens of transformers' sampling after that seed (finetune.inference.sampling), alone or among others. Requests
arriving together are batched (finetune.inference.engine: transformers' continuous batching, or a batching queue for
a disk-offloaded model and for sampled requests); each gets the tokens it would get alone.

A bad request gets a 4xx JSON error in OpenAI's shape ({"error": {"message", "type", "param", "code"}}) and the
server keeps serving: unknown model (404), malformed JSON or fields, OpenAI fields not implemented here such as n > 1
or logprobs (400, naming the field), `max_tokens` beyond the context (400),
a missing or wrong key with --api_key (401). SIGTERM or Ctrl-C stops it: open responses get --shutdown_timeout
seconds to finish, then the process ends. It listens on 127.0.0.1 unless --host says otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

try:  # at module level: FastAPI reads the routes' annotations here
    from starlette.requests import Request as HTTPRequest
except ImportError:  # the serve extra is not installed: main() says so
    HTTPRequest = None

from finetune.inference.generate import GenerationError, ModelArgs, _flag


@dataclass
class ServeArgs(ModelArgs):
    """The model and its adapters, where to listen, and the limits of a request"""

    adapter: list[str] = _flag(list, help="A LoRA adapter to serve over the base, as NAME=FOLDER (the request's "
                                          "`model` NAME picks it) or FOLDER (named by the folder). Repeatable.",
                               repeat=True)
    served_model_name: str | None = _flag(help="The base model's name in requests (default: its folder's name).")
    host: str = _flag("127.0.0.1", help="Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every "
                                        "interface).")
    port: int = _flag(8000, help="Port to listen on.")
    api_key: str | None = _flag(help="Require `Authorization: Bearer KEY` on every /v1 request.")
    max_model_len: int | None = _flag(help="Prompt plus completion tokens, at most (default: the model's context, "
                                           "at most 2048). The cache holds --max_concurrent requests this long.")
    max_tokens: int = _flag(256, help="Completion tokens when a request gives no max_tokens (capped by the context).")
    max_concurrent: int = _flag(8, help="Requests generated together; more wait their turn.")
    batching: str = _flag("auto", help="continuous (transformers' continuous batching), queue (waiting requests in one "
                                       "padded generate call), or auto: continuous unless the model is offloaded to "
                                       "disk.")
    shutdown_timeout: float = _flag(3.0, help="Seconds open responses get to finish after SIGTERM or Ctrl-C.")


def command():
    from finetune.config.parser import Command

    return Command("finetune serve", {"args": ServeArgs}, description="Serve a model and its adapters over an "
                   "OpenAI-compatible HTTP API.", epilog=__doc__.split("\n\n", 1)[1])


def adapter_specs(values: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """--adapter NAME=FOLDER or FOLDER -> [(name, folder)], and the problems."""
    specs, problems = [], []
    for value in values:
        name, eq, folder = value.partition("=")
        if not eq:
            name, folder = Path(value.rstrip("/")).name, value
        if not name or not folder:
            problems.append(f"--adapter {value}: give NAME=FOLDER or FOLDER")
        elif not Path(folder).is_dir():
            problems.append(f"--adapter {value}: {folder}: no such folder")
        elif name in [n for n, _ in specs]:
            problems.append(f"--adapter {value}: the name '{name}' is given twice; name each adapter (NAME=FOLDER)")
        else:
            specs.append((name, folder))
    return specs, problems


def check_args(parsed) -> list[str]:
    from finetune.inference.engine import BATCHINGS
    from finetune.inference.generate import model_problems

    args: ServeArgs = parsed.args
    problems = model_problems(args)
    problems += adapter_specs(args.adapter)[1]
    for key in ("max_tokens", "max_concurrent") + (("max_model_len",) if args.max_model_len is not None else ()):
        if getattr(args, key) < 1:
            problems.append(f"--{key}: must be at least 1, got {getattr(args, key)}")
    if not 0 < args.port < 65536:
        problems.append(f"--port: {args.port} is not a port (1-65535)")
    if args.batching not in BATCHINGS:
        from finetune.errors import did_you_mean

        problems.append(f"--batching: '{args.batching}' is not one of {', '.join(BATCHINGS)}"
                        f"{did_you_mean(args.batching, list(BATCHINGS))}")
    if args.shutdown_timeout < 0:
        problems.append(f"--shutdown_timeout: must be 0 or more, got {args.shutdown_timeout}")
    return problems


# ----------------------------------------------------------------------------------------------
# Loading


def load_served(args: ServeArgs, log) -> tuple[Any, Any, dict[str, str | None]]:
    """The base with every adapter attached (peft names "default", "a1", ...); returns (model, tokenizer, served name ->
    peft adapter name, None for the base)."""
    from finetune.inference.generate import _offload_hooks, load_for_inference, load_options

    specs, _ = adapter_specs(args.adapter)
    opts = load_options(args, specs[0][1] if specs else None)
    model, tokenizer, _ = load_for_inference(opts, log=log)
    base_name = args.served_model_name or Path(opts.model_name_or_path.rstrip("/")).name
    names: dict[str, str | None] = {base_name: None}
    if specs:
        if len(specs) > 1 and _offload_hooks(model.get_base_model()):
            raise GenerationError("several adapters over a base offloaded to disk or CPU are not supported: serve one "
                                  "adapter (--adapter), or give the base room in memory (--max_memory, --device_map)")
        names[specs[0][0]] = "default"
        for i, (name, folder) in enumerate(specs[1:], start=1):
            _check_adapter(folder, opts)
            try:
                model.load_adapter(folder, adapter_name=f"a{i}")
            except (RuntimeError, ValueError, KeyError) as e:
                raise GenerationError(f"--adapter {name}={folder} could not be applied to {opts.model_name_or_path}: "
                                      f"{e}") from None
            names[name] = f"a{i}"
        model.eval()
    if len(names) != len(specs) + 1:
        raise GenerationError(f"--adapter: the name '{base_name}' is the base model's; name the adapter otherwise "
                              "(NAME=FOLDER), or the base (--served_model_name)")
    return model, tokenizer, names


def _check_adapter(folder: str, opts) -> None:
    from finetune.models.adapter import AdapterError, check_adapter
    from finetune.models.load import empty_model, resolve_dtype

    try:
        check_adapter(folder, opts.model_name_or_path,
                      empty_model(opts.model_name_or_path, resolve_dtype(opts.torch_dtype), opts.trust_remote_code))
    except AdapterError as e:
        raise GenerationError(str(e)) from None


def context_length(model, requested: int | None) -> int:
    if requested:
        return requested
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return min(getattr(config, "max_position_embeddings", None) or 2048, 2048)


# ----------------------------------------------------------------------------------------------
# Requests


class APIError(Exception):
    """A request the server refuses: its HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = {401: "authentication_error", 404: "invalid_request_error"}.get(self.status, "invalid_request_error")
        if self.status >= 500:
            kind = "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or OpenAI's list of parts of which only text parts are taken."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise APIError(400, f"{where}: only text parts are supported", "messages")
        return "".join(p["text"] for p in content)
    raise APIError(400, f"{where}.content: expected a string or a list of text parts", "messages")


class Service:
    """What a request needs: the engine, the tokenizer, the served names, the limits."""

    def __init__(self, engine, tokenizer, names: dict[str, str | None], *, max_model_len: int, max_tokens: int,
                 api_key: str | None):
        self.engine, self.tokenizer, self.names = engine, tokenizer, names
        self.max_model_len, self.max_tokens, self.api_key = max_model_len, max_tokens, api_key
        self.created = int(time.time())

    def check_key(self, header: str | None) -> None:
        if self.api_key is None:
            return
        if not header or header != f"Bearer {self.api_key}":
            raise APIError(401, "a valid API key is needed: send `Authorization: Bearer KEY` (the server's --api_key)",
                           code="invalid_api_key")

    def model_of(self, body: dict) -> str:
        name = body.get("model")
        if not isinstance(name, str):
            raise APIError(400, "'model' is required: one of " + ", ".join(self.names), "model")
        if name not in self.names:
            from finetune.errors import did_you_mean

            raise APIError(404, f"the model '{name}' does not exist here{did_you_mean(name, list(self.names))}; this "
                                f"server serves: {', '.join(self.names)}", "model", "model_not_found")
        return name

    def prompt_ids_chat(self, body: dict) -> list[int]:
        from finetune.inference.generate import render

        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty list of {role, content}", "messages")
        plain = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(400, f"messages[{i}]: expected {{'role': str, 'content': ...}}", "messages")
            plain.append({"role": m["role"], "content": _text_of(m.get("content"), f"messages[{i}]")})
        try:
            prompt = render(self.tokenizer, plain, True, "messages")
        except GenerationError as e:
            raise APIError(400, str(e), "messages") from None
        except Exception as e:  # the chat template refused the conversation (e.g. roles that must alternate)
            raise APIError(400, f"the model's chat template refused these messages: {e}", "messages") from None
        return self.tokenizer(prompt.text, add_special_tokens=False)["input_ids"]

    def prompt_ids_text(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise APIError(400, "'prompt' must be a non-empty string (one prompt per request)", "prompt")
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def budget(self, body: dict, prompt_len: int) -> int:
        """max_tokens (or max_completion_tokens), checked against the context."""
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        room = self.max_model_len - prompt_len
        if room < 1:
            raise APIError(400, f"the prompt is {prompt_len} tokens; the context is {self.max_model_len} tokens, which "
                                "leaves no room for a completion", "messages", "context_length_exceeded")
        value = body.get(key)
        if value is None:
            return min(self.max_tokens, room)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise APIError(400, f"'{key}' must be a positive integer", key)
        if value > room:
            raise APIError(400, f"'{key}' {value} plus the prompt's {prompt_len} tokens is beyond the context of "
                                f"{self.max_model_len} tokens: ask for {room} or fewer", key, "context_length_exceeded")
        return value


# OpenAI's fields this server does not implement: a request that uses one is refused, naming it, rather than answered
# as if it were not there. (field, the values that mean "not used", why)
UNSUPPORTED = (
    ("n", (None, 1), "one completion per request: send n=1 or leave it out"),
    ("best_of", (None, 1), "one completion per request: send best_of=1 or leave it out"),
    ("stop", (None, "", []), "stop sequences are not supported; the model's own stop tokens end a completion"),
    ("logprobs", (None, False, 0), "log probabilities are not returned"),
    ("top_logprobs", (None, 0), "log probabilities are not returned"),
    ("echo", (None, False), "the prompt is not echoed"),
    ("suffix", (None, ""), "insertion (a suffix) is not supported"),
    ("logit_bias", (None, {}), "logit_bias is not supported"),
    ("frequency_penalty", (None, 0, 0.0), "penalties are not supported: send 0 or leave it out"),
    ("presence_penalty", (None, 0, 0.0), "penalties are not supported: send 0 or leave it out"),
    ("tools", (None, []), "tool calls are not supported"),
    ("response_format", (None, {"type": "text"}), "only free text is returned (response_format {\"type\": \"text\"})"),
)


def sampling_of(body: dict):
    """The request's decoding: None (greedy: no temperature, or 0) or a Sampling (temperature above 0, top_p, seed).
    Fields this server does not implement are refused (400, naming the field)."""
    from finetune.inference.sampling import SEED_LIMIT, Sampling

    for key, unused, why in UNSUPPORTED:
        if key in body and not any(type(body[key]) is type(u) and body[key] == u for u in unused):
            raise APIError(400, f"'{key}': {why}", key)
    values = {}
    for key, low, high, low_open in (("temperature", 0, 2, False), ("top_p", 0, 1, True)):
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
            raise APIError(400, f"'{key}' must be a number", key)
        if value > high or value < low or (low_open and value == low):
            raise APIError(400, f"'{key}' must be {'above' if low_open else 'at least'} {low} and at most {high}, got "
                                f"{value}", key)
        values[key] = float(value)
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < SEED_LIMIT):
        raise APIError(400, f"'seed' must be an integer from 0 to {SEED_LIMIT - 1}, got {seed!r}", "seed")
    if not values.get("temperature"):
        if values.get("top_p", 1.0) < 1.0:
            raise APIError(400, "'top_p' applies to sampling: send a temperature above 0 with it (without one, or with "
                                "0, this server decodes greedily)", "top_p")
        return None
    return Sampling(values["temperature"], values.get("top_p", 1.0), seed)


def build_app(service: Service):
    """The FastAPI application: the routes, and errors in OpenAI's shape."""
    import asyncio

    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException
    from starlette.responses import StreamingResponse

    from finetune.inference.engine import Request, TextStream, finish_reason, visible

    app = FastAPI(title="finetune serve")

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e: RequestValidationError):
        return JSONResponse(APIError(400, str(e)).body(), status_code=400)

    async def body_of(request: HTTPRequest) -> dict:
        service.check_key(request.headers.get("authorization"))
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        if service.engine.error:
            raise APIError(503, service.engine.error)
        return body

    @app.get("/v1/models")
    async def models(request: HTTPRequest):
        service.check_key(request.headers.get("authorization"))
        return {"object": "list", "data": [{"id": name, "object": "model", "created": service.created,
                                            "owned_by": "finetune", "parent": None if adapter is None else
                                            next(n for n, a in service.names.items() if a is None)}
                                           for name, adapter in service.names.items()]}

    @app.get("/stats")
    async def stats():
        """Not OpenAI's: how the engine batches, and the most requests (and sampled requests) it generated together so
        far."""
        return {"batching": service.engine.batching, "max_running": service.engine.max_running,
                "max_running_sampled": service.engine.max_sampled}

    def submit(name: str, prompt_ids: list[int], max_new_tokens: int, stream: bool,
               sampling) -> tuple[str, asyncio.Queue]:
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        def on_output(tokens: list[int], done: bool, error: str | None) -> None:
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, (tokens, done, error))
            except RuntimeError:  # the event loop closed: the server is stopping
                pass

        rid = f"cmpl-{uuid.uuid4().hex}"
        service.engine.submit(Request(rid, name, prompt_ids, max_new_tokens, on_output, stream=stream,
                                      sampling=sampling))
        return rid, outputs

    async def complete(kind: str, body: dict):
        name = service.model_of(body)
        prompt_ids = service.prompt_ids_chat(body) if kind == "chat" else service.prompt_ids_text(body)
        sampling = sampling_of(body)
        budget = service.budget(body, len(prompt_ids))
        stream = bool(body.get("stream"))
        # vLLM's extension: the completion's token ids in the choice (what a check of exact decoding compares)
        with_ids = body.get("return_token_ids")
        if with_ids not in (None, True, False):
            raise APIError(400, "'return_token_ids' must be true or false", "return_token_ids")
        if with_ids and stream:
            raise APIError(400, "'return_token_ids' is given with a whole reply, not a stream: send it without "
                                "\"stream\": true", "return_token_ids")
        rid, outputs = submit(name, prompt_ids, budget, stream, sampling)
        created, stop_ids = int(time.time()), service.engine.stop_ids
        usage = lambda tokens: {"prompt_tokens": len(prompt_ids), "completion_tokens": len(visible(tokens, stop_ids)),
                                "total_tokens": len(prompt_ids) + len(visible(tokens, stop_ids))}
        obj = "chat.completion" if kind == "chat" else "text_completion"
        if not stream:
            try:
                tokens, done, error = await outputs.get()
                while not done:
                    tokens, done, error = await outputs.get()
            except asyncio.CancelledError:
                service.engine.cancel(rid)
                raise
            if error:
                raise APIError(500, f"generation failed: {error}")
            text = service.tokenizer.decode(visible(tokens, stop_ids), skip_special_tokens=True)
            reason = finish_reason(tokens, stop_ids)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
                      if kind == "chat" else {"index": 0, "text": text, "finish_reason": reason, "logprobs": None})
            if with_ids:
                choice["token_ids"] = visible(tokens, stop_ids)
            return {"id": rid, "object": obj, "created": created, "model": name, "choices": [choice],
                    "usage": usage(tokens)}

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def event(delta: str | None, reason: str | None, first: bool = False, tokens=None) -> str:
            if kind == "chat":
                d = ({"role": "assistant", "content": ""} if first else {} if delta is None else {"content": delta})
                choice = {"index": 0, "delta": d, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
            chunk = {"id": rid, "object": obj + (".chunk" if kind == "chat" else ""), "created": created, "model": name,
                     "choices": [choice]}
            if include_usage:
                chunk["usage"] = None
            return f"data: {json.dumps(chunk)}\n\n"

        async def events():
            text = TextStream(service.tokenizer, stop_ids)
            finished = False
            try:
                if kind == "chat":
                    yield event(None, None, first=True)
                while True:
                    tokens, done, error = await outputs.get()
                    if error:
                        yield f"data: {json.dumps(APIError(500, f'generation failed: {error}').body())}\n\n"
                        break
                    delta = text.delta(tokens, done)
                    if delta:
                        yield event(delta, None)
                    if done:
                        yield event(None, finish_reason(tokens, stop_ids))
                        if include_usage:
                            yield f"data: {json.dumps({'id': rid, 'object': obj + '.chunk', 'created': created, 'model': name, 'choices': [], 'usage': usage(tokens)})}\n\n"
                        break
                finished = True
                yield "data: [DONE]\n\n"
            finally:
                if not finished:  # the client went away, or the server is stopping
                    service.engine.cancel(rid)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await complete("chat", await body_of(request))

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await complete("text", await body_of(request))

    return app


# ----------------------------------------------------------------------------------------------
# The command


def parse_args(argv: list[str] | None = None) -> ServeArgs:
    return command().parse_or_exit(argv, check_args).args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if HTTPRequest is None or importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        print("finetune serve: FastAPI and uvicorn are not installed: pip install 'finetune[serve]'", file=sys.stderr)
        raise SystemExit(2)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from finetune.inference.generate import _quiet_libraries

    _quiet_libraries()
    try:
        serve(args)
    except GenerationError as e:
        print(f"finetune serve: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    from finetune import process

    # Stopped: the process (`finetune serve` itself, not a caller) ends without the interpreter's shutdown, which
    # took seconds more tearing down torch and the threads (seconds of the stop the user waits for).
    process.end_finished_process(0, own_process=True)


def serve(args: ServeArgs) -> None:
    import socket

    import uvicorn

    from finetune.inference.engine import Engine

    problems = check_args(SimpleNamespace(args=args))
    if problems:
        raise GenerationError("; ".join(problems))
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    # The port is checked before the model loads: a port in use is a message in a second, not after the weights.
    try:
        with socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((args.host, args.port))
    except OSError as e:
        raise GenerationError(f"--host {args.host} --port {args.port}: cannot listen there ({e.strerror}); choose "
                              "another --port") from None
    started = time.time()
    model, tokenizer, names = load_served(args, log)
    max_model_len = context_length(model, args.max_model_len)
    engine = Engine(model, tokenizer, names, batching=args.batching, max_model_len=max_model_len,
                    max_concurrent=args.max_concurrent, log=log).start()
    service = Service(engine, tokenizer, names, max_model_len=max_model_len, max_tokens=args.max_tokens,
                      api_key=args.api_key)
    config = uvicorn.Config(build_app(service), host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.shutdown_timeout, access_log=False)
    log(f"finetune serve: {', '.join(names)} ({engine.batching} batching, context {max_model_len} tokens, loaded in "
        f"{time.time() - started:.1f} s) on http://{args.host}:{args.port}/v1"
        + (" (API key required)" if args.api_key else ""))

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # The engine stops first: open responses end at once with an error ("the server is stopping") instead of
            # running to their last token, so the graceful shutdown has nothing left to wait for.
            engine.shutdown()
            super().handle_exit(sig, frame)

    # uvicorn raises the signal again once stopped, for the handler it found: a no-op, so the run returns here.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    t = time.time()
    try:
        Server(config).run()
        t = time.time()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engine.close(timeout=2.0)
        log(f"finetune serve: stopped ({time.time() - t:.1f} s after the server's last response)")


if __name__ == "__main__":
    main()
