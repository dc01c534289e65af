"""The OpenAI chat-completions wire format: requests checked field by field, responses and errors.

Supported request fields: model (any name: the gateway serves one policy), messages, tools,
tool_choice, temperature, top_p, max_tokens / max_completion_tokens, n, stop, seed, logprobs,
top_logprobs (0 only: the rollout engines return the sampled token's logprob, not alternatives),
vLLM's `return_token_ids` (the prompt and sampled token ids in the response), and `stream` with
`stream_options.include_usage`: the completion is generated whole, then sent as server-sent events
(`stream_events`: a role chunk, the content, the tool calls, the finish reason, usage, `[DONE]`),
for clients that only stream (verifiers' harness programs). Logprobs are the raw model's
(temperature 1; see sleuth.rollout.base). Other fields are ignored. Errors use OpenAI's shape:
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from sleuth.errors import UserError
from sleuth.gateway.history import check_messages, message_key
from sleuth.gateway.tools import ToolCall, check_tool_choice, check_tools

MAX_N = 64


class GatewayError(Exception):
    """An error answered with `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param

    def body(self) -> dict[str, Any]:
        kind = "not_found_error" if self.status == 404 else ("invalid_request_error" if self.status < 500
                                                             else "server_error")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: str
    temperature: float | None
    top_p: float | None
    max_tokens: int | None
    n: int
    stop: tuple[str, ...]
    seed: int | None
    logprobs: bool
    return_token_ids: bool
    stream: bool = False
    stream_usage: bool = False

    @functools.cached_property
    def keys(self) -> list[str]:
        """message_key of each message (computed once: matching and recording both need them)."""
        return [message_key(m) for m in self.messages]


def _number(body: dict[str, Any], key: str, low: float, high: float, integer: bool = False) -> Any:
    value = body.get(key)
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise GatewayError(400, f"'{key}' must be {kind} in [{low:g}, {high:g}], got {value!r}", param=key)
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise GatewayError(400, "'stop' must be a non-empty string or a list of them", param="stop")
    return tuple(stops)


def parse_body(raw: bytes) -> Any:
    """The request body's JSON, or GatewayError(400): not JSON, nested too deeply, or holding text
    that is not valid Unicode (a lone surrogate such as "\\ud800", which no tokenizer or UTF-8
    response can carry)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise GatewayError(400, "the request body is not valid JSON") from None
    except RecursionError:
        raise GatewayError(400, "the request body is nested too deeply") from None
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise GatewayError(400, "the request body holds a lone surrogate (e.g. \\ud800): not valid Unicode "
                                "text") from None
    except RecursionError:
        raise GatewayError(400, "the request body is nested too deeply") from None
    return body


def parse_chat_request(body: Any) -> ChatRequest:
    """The request, or GatewayError(400) naming the first bad field."""
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object")
    stream = body.get("stream") or False
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise GatewayError(400, "'stream' must be true or false and 'stream_options' an object", param="stream")
    try:
        messages = check_messages(body.get("messages"))
        tools = check_tools(body.get("tools"))
        tool_choice = check_tool_choice(body.get("tool_choice"), tools)
    except UserError as e:
        raise GatewayError(400, str(e)) from None
    if body.get("top_logprobs"):
        _number(body, "top_logprobs", 0, 20, integer=True)
        raise GatewayError(400, "'top_logprobs' > 0 is not supported: the rollout engines return the sampled "
                                "token's logprob only (use logprobs=true)", param="top_logprobs")
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise GatewayError(400, "'logprobs' must be true or false", param="logprobs")
    max_tokens = _number(body, "max_completion_tokens", 1, 2**31, integer=True)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", 1, 2**31, integer=True)
    return ChatRequest(
        messages=messages, tools=tools, tool_choice=tool_choice,
        temperature=_number(body, "temperature", 0, 2), top_p=_number(body, "top_p", 1e-9, 1),
        max_tokens=max_tokens, n=_number(body, "n", 1, MAX_N, integer=True) or 1, stop=_stop(body.get("stop")),
        seed=_number(body, "seed", -(2**63), 2**63 - 1, integer=True), logprobs=logprobs,
        return_token_ids=bool(body.get("return_token_ids")),
        stream=stream, stream_usage=bool(options.get("include_usage")),
    )


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    """The text up to the first stop string (OpenAI leaves the stop string out)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


def choice_body(index: int, content: str, calls: list[ToolCall], finish_reason: str,
                logprobs: list[dict[str, Any]] | None, token_ids: list[int] | None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = [c.openai() for c in calls]
    reason = "tool_calls" if calls else ("stop" if finish_reason == "stop" else "length")
    out = {"index": index, "message": message, "finish_reason": reason,
           "logprobs": {"content": logprobs} if logprobs is not None else None}
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def token_logprobs(tokenizer: Any, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
    out = []
    for t, lp in zip(ids, logprobs, strict=True):
        text = tokenizer.decode([t], skip_special_tokens=False)
        out.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
    return out


def completion_body(model: str, choices: list[dict[str, Any]], prompt_ids: list[int], completion_tokens: int,
                    return_token_ids: bool) -> dict[str, Any]:
    out = {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
        "model": model, "choices": choices,
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                  "total_tokens": len(prompt_ids) + completion_tokens},
    }
    if return_token_ids:
        out["prompt_token_ids"] = prompt_ids
    return out


def stream_events(body: dict[str, Any], include_usage: bool) -> list[bytes]:
    """A whole chat.completion `body` as the server-sent events of a streamed one
    (chat.completion.chunk objects, then `data: [DONE]`)."""
    head = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": body["model"]}

    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return b"data: " + json.dumps({**head, "choices": choices, **extra}).encode() + b"\n\n"

    out = []
    for choice in body["choices"]:
        i, message = choice["index"], choice["message"]
        out.append(event([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]))
        if message.get("content"):
            out.append(event([{"index": i, "delta": {"content": message["content"]}, "finish_reason": None,
                               "logprobs": choice["logprobs"]}]))
        if message.get("tool_calls"):
            calls = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            out.append(event([{"index": i, "delta": {"tool_calls": calls}, "finish_reason": None}]))
        out.append(event([{"index": i, "delta": {}, "finish_reason": choice["finish_reason"]}]))
    if include_usage:
        out.append(event([], usage=body["usage"]))
    return [*out, b"data: [DONE]\n\n"]
