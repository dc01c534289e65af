"""sleuth's OpenAI-compatible gateway: Starlette on uvicorn, served from a RolloutEngine.

    gateway = Gateway(engine, tokenizer, SamplingParams(max_tokens=256))
    with GatewayServer(gateway) as server:               # 127.0.0.1, a free port
        episode = gateway.store.open(SamplingParams(seed=1), max_turns=8)
        client = openai.AsyncOpenAI(base_url=server.url(episode.id), api_key="sleuth")

Routes: `/v1/chat/completions` and `/v1/models` (stateless: nothing recorded, what `sleuth serve`
offers), and the same under `/e/{episode_id}/v1/...`: the episode's calls are recorded token-exact
(episodes.py); an unknown or closed episode is a 404. Every error is an OpenAI error body with
its status (400 bad request or context too long, 404 unknown episode or route, 405 wrong method,
413 body over MAX_BODY_BYTES, 421 a Host that is not allowed, 500 engine failure), never a
traceback and never plain text.

Hostile input is bounded before it costs anything: the body is read up to MAX_BODY_BYTES, a prompt
whose text cannot fit the context (more characters than context x the longest token) is refused
before it is tokenized, and a large prompt is rendered and tokenized on a worker thread, off the
event loop that serves every other request (in training: every episode). The Host header must name
a loopback address or the bound host (or one allowed with `sleuth serve --allow-host`): a web page
cannot reach the server through DNS rebinding, and a browser request from another site's page
(its Origin header names that site) is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from sleuth.errors import UserError
from sleuth.gateway.history import (
    ChatTemplate,
    Episode,
    EpisodeStore,
    Turn,
    arguments_value,
    extension_ids,
    message_key,
)
from sleuth.gateway.protocol import (
    ChatRequest,
    GatewayError,
    choice_body,
    completion_body,
    cut_at_stop,
    parse_body,
    parse_chat_request,
    stream_events,
    token_logprobs,
)
from sleuth.gateway.tools import parse_tool_calls
from sleuth.records import Sample, SamplingParams
from sleuth.rollout.base import GenerationRequest, RolloutEngine

MODEL_NAME = "policy"
MAX_BODY_BYTES = 32 * 2**20
"""The largest request body the gateway reads (413 past it)."""
OFF_LOOP_CHARS = 32_768
"""Requests with more message text than this are rendered and tokenized on a worker thread."""
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class Gateway:
    """Chat completions over a rollout engine, with episode bookkeeping."""

    def __init__(self, engine: RolloutEngine, tokenizer: Any, defaults: SamplingParams | None = None,
                 model_name: str = MODEL_NAME) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.template = ChatTemplate(tokenizer)
        self.defaults = defaults or SamplingParams()
        self.model_name = model_name
        self.store = EpisodeStore()
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.max_token_chars = max(map(len, vocab), default=0) or 64
        """The longest token's text: a prompt of n characters has at least n / this many tokens."""

    async def chat(self, request: ChatRequest, episode: Episode | None) -> dict[str, Any]:
        chars = sum(len(m["content"]) for m in request.messages)
        if chars > self.engine.context_len * self.max_token_chars:
            raise GatewayError(400, f"the messages hold {chars} characters, more than the model's context of "
                                    f"{self.engine.context_len} tokens can take", code="context_length_exceeded",
                               param="messages")
        try:
            if chars > OFF_LOOP_CHARS:
                parent, prompt = await asyncio.to_thread(self._prompt, request, episode)
            else:
                parent, prompt = self._prompt(request, episode)
        except UserError as e:
            raise GatewayError(400, str(e), param="messages") from None
        sampling = self._sampling(request, episode)
        if len(prompt) >= self.engine.context_len:
            raise GatewayError(400, f"the prompt has {len(prompt)} tokens; the model's context is "
                                    f"{self.engine.context_len} tokens", code="context_length_exceeded",
                               param="messages")
        rid = f"{episode.id}-{episode.calls}" if episode else "serve"
        try:
            result = await self.engine.generate(GenerationRequest(prompt, request.n, sampling, rid))
        except UserError as e:
            raise GatewayError(400, str(e)) from None
        choices, sampled = [], 0
        for i, sample in enumerate(result.samples):
            text = cut_at_stop(sample.text, request.stop)
            content, calls, bad = (parse_tool_calls(text, f"call-{rid}-{i}") if request.tool_choice != "none"
                                   else (text, [], 0))
            choice = choice_body(i, content, calls, sample.finish_reason,
                                 token_logprobs(self.tokenizer, sample.token_ids, sample.logprobs)
                                 if request.logprobs else None,
                                 sample.token_ids if request.return_token_ids else None)
            choices.append(choice)
            sampled += len(sample.token_ids)
            if episode is not None:
                self._record(episode, request, parent, prompt, sample, choice["message"], bad)
        if episode is not None:
            with episode.lock:
                episode.sampled_tokens += sampled
        return completion_body(self.model_name, choices, prompt, sampled, request.return_token_ids)

    def _prompt(self, request: ChatRequest, episode: Episode | None) -> tuple[Turn | None, list[int]]:
        """The parent turn the request extends (None: a new sequence) and the prompt ids."""
        parent = None
        if episode is not None:
            with episode.lock:
                if episode.max_turns is not None and episode.calls >= episode.max_turns:
                    raise GatewayError(400, f"episode {episode.id} reached its limit of {episode.max_turns} "
                                            "calls (task.episode.max_turns)", code="max_turns_exceeded")
                parent = episode.parent_for(request.keys, _tools_key(request))
        if parent is not None:
            inserted = extension_ids(self.template, parent, request.messages, request.tools)
            if inserted is not None:
                return parent, parent.ids + inserted
            with episode.lock:  # type: ignore[union-attr]
                episode.counts["template_mismatch"] += 1  # type: ignore[union-attr]
        text = self.template.render(request.messages, request.tools, generation_prompt=True)
        spans = self.template.content_spans(request.messages, request.tools, True, text)
        return None, self.template.encode(text, spans)

    def _sampling(self, request: ChatRequest, episode: Episode | None) -> SamplingParams:
        base = episode.sampling if episode is not None else self.defaults
        max_tokens = request.max_tokens or base.max_tokens
        if episode is not None:  # training: rollout.max_tokens caps every call
            max_tokens = min(max_tokens, base.max_tokens)
        seed = request.seed
        if episode is not None:
            with episode.lock:
                if episode.token_budget is not None:
                    left = episode.token_budget - episode.sampled_tokens
                    if left < 1:
                        raise GatewayError(400, f"episode {episode.id} used its budget of {episode.token_budget} "
                                                "sampled tokens", code="token_budget_exceeded")
                    max_tokens = min(max_tokens, left)
                if seed is None and base.seed is not None:
                    seed = base.seed + 7919 * episode.calls  # each call of the episode its own draws
                episode.calls += 1
        return replace(base, temperature=base.temperature if request.temperature is None else request.temperature,
                       top_p=base.top_p if request.top_p is None else request.top_p, max_tokens=max_tokens,
                       stop=request.stop or base.stop, seed=seed)

    def _record(self, episode: Episode, request: ChatRequest, parent: Turn | None, prompt: list[int],
                sample: Sample, message: dict[str, Any], bad_tool_calls: int) -> None:
        reply = {"role": "assistant", "content": message["content"] or "",
                 "tool_calls": [{"function": {"name": c["function"]["name"],
                                              "arguments": arguments_value(c["function"]["arguments"])}}
                                for c in message.get("tool_calls", [])]}
        ids, n = prompt + sample.token_ids, len(sample.token_ids)
        base_mask = parent.mask if parent is not None else []
        base_lp = parent.logprobs if parent is not None else []
        inserted = len(prompt) - len(base_mask)
        turn = Turn(keys=[*request.keys, message_key(reply)],
                    tools_key=_tools_key(request), ids=ids, mask=base_mask + [0] * inserted + [1] * n,
                    logprobs=base_lp + [0.0] * inserted + list(sample.logprobs),
                    prompt_len=parent.prompt_len if parent is not None else len(prompt),
                    finish_reason=sample.finish_reason, text=sample.text)
        with episode.lock:
            if parent is not None:
                parent.extended = True
            episode.turns.append(turn)
            episode.counts["bad_tool_calls"] += bad_tool_calls


def _tools_key(request: ChatRequest) -> str:
    return json.dumps(request.tools, sort_keys=True) if request.tools else ""


class SafeJSONResponse(JSONResponse):
    """JSON that always encodes: text a model or client got past the checks with a lone surrogate
    is written \\u-escaped instead of failing the response."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body, or GatewayError(413) as soon as it is known to pass `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise GatewayError(413, f"the request body has {int(declared)} bytes; the gateway takes at most {limit}",
                           code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise GatewayError(413, f"the request body is over {limit} bytes, the most the gateway takes",
                               code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def host_allowed(host_header: str | None, allowed: set[str]) -> bool:
    """Whether a Host header names an allowed host (any port); a request without one is allowed."""
    if not host_header:
        return True
    host = host_header.strip().lower()
    host = host[1:host.index("]")] if host.startswith("[") and "]" in host else host.rpartition(":")[0] or host
    return host in allowed


class CheckHost:
    """ASGI middleware: a request whose Host (421) or Origin (403: a browser's cross-site request)
    names a host outside `allowed` gets an OpenAI error body ("*" in allowed: any host)."""

    def __init__(self, app: Any, allowed: set[str]) -> None:
        self.app, self.allowed = app, allowed

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and "*" not in self.allowed:
            headers = dict(scope["headers"])
            host = headers.get(b"host", b"").decode("latin-1")
            origin = headers.get(b"origin", b"").decode("latin-1")
            origin_host = origin.partition("://")[2] if "://" in origin else (origin or None)
            bad = None
            if not host_allowed(host, self.allowed):
                bad = GatewayError(421, _not_served("Host", host), code="host_not_allowed")
            elif origin_host is not None and not host_allowed(origin_host or "-", self.allowed):
                bad = GatewayError(403, _not_served("Origin", origin), code="origin_not_allowed")
            if bad is not None:
                await SafeJSONResponse(bad.body(), status_code=bad.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _not_served(header: str, value: str) -> str:
    shown = value.encode("ascii", "backslashreplace").decode()[:100]
    return f"{header} '{shown}' is not served here (only loopback names and the hosts given with --allow-host)"


def build_app(gateway: Gateway, allowed_hosts: tuple[str, ...] = ()) -> Any:
    """The ASGI application of a Gateway (Starlette: the routes take raw requests and return JSON
    bodies we build, so FastAPI's validation layer would only add time to every call). Requests must
    name a loopback host or one of `allowed_hosts` in their Host header ("*": any)."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    allowed = {h.lower() for h in (*LOOPBACK_HOSTS, *allowed_hosts)}

    def error(e: GatewayError) -> JSONResponse:
        return SafeJSONResponse(e.body(), status_code=e.status)

    def episode_of(episode_id: str) -> Episode:
        episode = gateway.store.get(episode_id)
        if episode is None:
            raise GatewayError(404, f"unknown episode '{episode_id}' (finished, or never opened)",
                               code="episode_not_found")
        return episode

    async def complete(request: Request) -> Response:
        episode_id = request.path_params.get("episode_id")
        try:
            episode = episode_of(episode_id) if episode_id is not None else None
            body = parse_body(await read_body(request))
            chat = parse_chat_request(body)
            reply = await gateway.chat(chat, episode)
            if chat.stream:  # generated whole, sent as events (protocol.stream_events)
                return StreamingResponse(iter(stream_events(reply, chat.stream_usage)),
                                         media_type="text/event-stream")
            return SafeJSONResponse(reply)
        except GatewayError as e:
            return error(e)
        except RecursionError:  # parsed, but too deep for a later step (a chat template rendering tools)
            return error(GatewayError(400, "the request is nested too deeply"))
        except Exception as e:  # an engine failure: one line, never a traceback
            return error(GatewayError(500, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))

    async def models(request: Request) -> JSONResponse:
        episode_id = request.path_params.get("episode_id")
        if episode_id is not None:
            try:
                episode_of(episode_id)
            except GatewayError as e:
                return error(e)
        return JSONResponse({"object": "list", "data": [{"id": gateway.model_name, "object": "model",
                                                         "created": 0, "owned_by": "sleuth"}]})

    async def http_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        return error(GatewayError(exc.status_code, str(exc.detail)))

    async def server_error(_request: Request, exc: Exception) -> JSONResponse:
        return error(GatewayError(500, f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"))

    from starlette.middleware import Middleware

    routes = [Route("/v1/chat/completions", complete, methods=["POST"]),
              Route("/e/{episode_id}/v1/chat/completions", complete, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/e/{episode_id}/v1/models", models, methods=["GET"])]
    return Starlette(routes=routes, middleware=[Middleware(CheckHost, allowed=allowed)],
                     exception_handlers={HTTPException: http_error, Exception: server_error})


class GatewayServer:
    """A Gateway served by uvicorn on a background thread (127.0.0.1; port 0: a free one)."""

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self.gateway = gateway
        config = uvicorn.Config(build_app(gateway, (host,)), host=host, port=port, log_level="warning", lifespan="off", timeout_graceful_shutdown=1,
                                access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="sleuth-gateway", daemon=True)
        self.host, self.port = host, port

    def start(self) -> GatewayServer:
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise UserError(f"the gateway could not listen on {self.host}:{self.port} (port in use?)")
            self._thread.join(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def url(self, episode_id: str | None = None) -> str:
        """The base_url for an OpenAI client (of one episode, or stateless)."""
        root = f"http://{self.host}:{self.port}"
        return f"{root}/e/{episode_id}/v1" if episode_id is not None else f"{root}/v1"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[GatewayServer]:
        """Serve on the running event loop instead of a thread, for as long as the block runs.

        Episodes and the server then share one loop: a call goes from the client to the server and
        back with no thread hand-off and no contention for the GIL between two busy threads (the
        rollout engine's thread is the third). Every block listens on a new port (port 0)."""
        import uvicorn

        class InLoopServer(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield  # on the main thread uvicorn would take SIGINT/SIGTERM from the run's own handler

        server = InLoopServer(self._server.config)
        task = asyncio.ensure_future(server.serve())
        while not server.started:
            if task.done():
                task.result()  # its exception, if any
                raise UserError(f"the gateway could not listen on {self.host}:{self.port} (port in use?)")
            await asyncio.sleep(0.005)
        previous, self.port = self.port, server.servers[0].sockets[0].getsockname()[1]
        try:
            yield self
        finally:
            server.should_exit = True
            await task
            self.port = previous

    def __enter__(self) -> GatewayServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_forever(gateway: Gateway, sock: socket.socket, allowed_hosts: tuple[str, ...] = ()) -> None:
    """Serve on an already bound socket in the foreground until interrupted (`sleuth serve`)."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(build_app(gateway, (host, *allowed_hosts)), host=host, port=port, log_level="info", lifespan="off")
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))
