"""Token-exact episode history: the ids each call was served, and the prompt of the next call.

An episode is a tree of turns. Each turn is one sampled choice of one call: the conversation up to
and including the reply (as messages, the way the client will send them back) and the exact token
ids behind it (prompt + sampled), with a mask of which ids the model sampled and their logprobs.

When a request's messages extend a turn's conversation (same tools, the turn's messages a strict
prefix of the request's), the new prompt is that turn's ids, then the chat template's tokens that
close the reply (what the model did not sample itself, e.g. ChatML's newline after <|im_end|>),
then the new messages as the template renders them -- the model's text is never re-tokenized.
The new messages' text is the template's rendering of the whole request minus its rendering of
the earlier conversation; a template for which that is not a prefix (e.g. one that rewrites
earlier turns) cannot be extended: the call starts a new sequence, and that is counted.
A request that extends nothing starts a new root (its own prompt); trajectories.py turns the
tree's leaves into training sequences.
"""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from sleuth.errors import UserError
from sleuth.records import SamplingParams

_SENTINEL = "\x00sleuth-reply\x00"


def _text(content: Any) -> str:
    """Message content as text: a string, None, or OpenAI content parts ({type: text, text})."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise UserError("message content parts must be {'type': 'text', 'text': str} (no images)")
            parts.append(p["text"])
        return "".join(parts)
    raise UserError("message content must be a string, null, or a list of text parts")


def arguments_value(args: Any) -> Any:
    """Tool-call arguments as an object (templates render dicts; clients send JSON text)."""
    if isinstance(args, str):
        try:
            value = json.loads(args)
            json.dumps(value, ensure_ascii=False).encode("utf-8")  # no lone surrogate inside
            return value
        except (ValueError, RecursionError):  # not JSON, not Unicode text, or nested too deeply: as sent
            return args
    return args


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """The request's messages as plain dicts for the chat template; UserError names what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise UserError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise UserError(f"messages[{i}] needs a 'role' of system, developer, user, assistant or tool")
        msg: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"],
                               "content": _text(m.get("content"))}
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                      for c in calls):
                raise UserError(f"messages[{i}].tool_calls must be a list of {{id, type, function}}")
            msg["tool_calls"] = [{"id": c.get("id", ""), "type": "function",
                                  "function": {"name": c["function"].get("name", ""),
                                               "arguments": arguments_value(c["function"].get("arguments", {}))}}
                                 for c in calls]
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def message_key(m: dict[str, Any]) -> str:
    """What must be equal for a sent-back message to be the one we served (ids and extra fields
    such as `refusal` do not count)."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
    return json.dumps([m["role"], m["content"], calls, m.get("tool_call_id"), m.get("name")], sort_keys=True)


@dataclass
class Turn:
    """One sampled choice of one call and the token ids behind its conversation."""

    keys: list[str]
    """message_key of each message through this reply."""
    tools_key: str
    ids: list[int]
    mask: list[int]
    """Over ids: 1 where the model sampled the token."""
    logprobs: list[float]
    """Over ids: the engine's logprob where sampled, else 0.0."""
    prompt_len: int
    """Where the root call's prompt ends (the sequence's training completion starts)."""
    finish_reason: str
    text: str
    extended: bool = False


@dataclass
class Episode:
    id: str
    sampling: SamplingParams
    """Defaults for what a request leaves out; its seed is the base of per-call seeds."""
    max_turns: int | None = None
    token_budget: int | None = None
    """Most tokens the model may sample in the episode (all calls and choices)."""
    turns: list[Turn] = field(default_factory=list)
    calls: int = 0
    sampled_tokens: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {"template_mismatch": 0, "bad_tool_calls": 0})
    lock: threading.Lock = field(default_factory=threading.Lock)

    def parent_for(self, keys: list[str], tools_key: str) -> Turn | None:
        """The turn whose conversation the request's extends the furthest (latest on a tie)."""
        best = None
        for turn in self.turns:
            n = len(turn.keys)
            if (turn.tools_key == tools_key and n < len(keys) and keys[:n] == turn.keys
                    and (best is None or n >= len(best.keys))):
                best = turn
        return best


class ChatTemplate:
    """Renders and tokenizes conversations with a tokenizer's chat template.

    Message contents are text: a special token's text inside one (ChatML's "<|im_start|>") is
    tokenized as ordinary text, never as the token (no role injection through content), as
    OpenAI's and vLLM's servers treat it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        special = [str(t) for t in added.values() if getattr(t, "special", True)]
        self.specials = sorted({t for t in [*special, *getattr(tokenizer, "all_special_tokens", [])] if len(t) > 1},
                               key=len, reverse=True)
        """The texts of the tokenizer's special tokens (role markers, end of turn), which it matches
        wherever they appear. Added tokens that are not special (Qwen's <tool_call>, <think>) are
        ordinary vocabulary and stay as they are."""
        self._escape_lock = threading.Lock()
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
        rendered = self.render(probe, None, generation_prompt=False)
        if _SENTINEL not in rendered:
            raise UserError("the chat template does not render assistant messages verbatim")
        self.reply_tail = rendered.split(_SENTINEL, 1)[1]
        """What the template writes after a reply's text (ChatML: '<|im_end|>\\n')."""

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               generation_prompt: bool) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                  tokenize=False, **kwargs)

    def content_spans(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      generation_prompt: bool, text: str) -> list[tuple[int, int]]:
        """Where in `text` (the rendering of messages) the contents that hold a special token's text
        lie: found by rendering each such content as a unique sentinel, so a content that equals
        the template's own text (a bare "<|im_start|>") is never confused with it. UserError when
        the template does not render such a content verbatim (it then cannot be escaped)."""
        marked = {i: f"{_SENTINEL}{i}\x00" for i, m in enumerate(messages)
                  if m["content"] and any(s in m["content"] for s in self.specials)}
        if not marked:
            return []
        rendered = self.render([dict(m, content=marked[i]) if i in marked else m for i, m in enumerate(messages)],
                               tools, generation_prompt)
        spans, pieces, cursor, length = [], [], 0, 0
        for i, sentinel in marked.items():
            at = rendered.find(sentinel, cursor)
            if at < 0 or rendered.count(sentinel) != 1:
                break
            content = messages[i]["content"]
            pieces += [rendered[cursor:at], content]
            length += at - cursor
            spans.append((length, length + len(content)))
            length += len(content)
            cursor = at + len(sentinel)
        if len(spans) != len(marked) or "".join(pieces) + rendered[cursor:] != text:
            raise UserError("a message's content holds a special token of the chat template, and the template "
                            "does not render that content verbatim, so it cannot be escaped")
        return spans

    def encode(self, text: str, spans: list[tuple[int, int]] | tuple[()] = ()) -> list[int]:
        """The ids of rendered text; the `spans` of it (message contents, content_spans) are
        tokenized as plain text: a special token's text there is not the token."""
        if not spans:
            return self._encode(text, False)
        ids, pos = [], 0
        for start, end in spans:
            ids += self._encode(text[pos:start], False) + self._encode(text[start:end], True)
            pos = end
        return ids + self._encode(text[pos:], False)

    def _encode(self, text: str, plain: bool) -> list[int]:
        if not text:
            return []
        backend = getattr(self.tokenizer, "backend_tokenizer", None)  # a fast tokenizer: skip the wrapper
        if backend is None:
            return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=plain)["input_ids"])
        if not plain:
            return list(backend.encode(text, add_special_tokens=False).ids)
        with self._escape_lock:  # the flag is the backend's: one escaped encode at a time
            backend.encode_special_tokens = True
            try:
                return list(backend.encode(text, add_special_tokens=False).ids)
            finally:
                backend.encode_special_tokens = False

    def closing_text(self, sampled_ids: list[int]) -> str:
        """The template's text after a reply that the model did not sample: all of reply_tail, less
        the end-of-turn token when the reply's last sampled token was it."""
        if sampled_ids:
            last = self.tokenizer.decode(sampled_ids[-1:], skip_special_tokens=False)
            if last and self.reply_tail.startswith(last):
                return self.reply_tail[len(last):]
        return self.reply_tail


def extension_ids(template: ChatTemplate, parent: Turn, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None) -> list[int] | None:
    """The ids inserted between the parent's last sampled token and the next reply, or None when
    the template does not render the request as the parent's conversation plus new text."""
    n = len(parent.keys)
    before = template.render(messages[:n], tools, generation_prompt=False)
    full = template.render(messages, tools, generation_prompt=True)
    if not full.startswith(before):
        return None
    sampled = parent.ids[len(parent.ids) - last_sampled_run(parent.mask):]
    closing = template.closing_text(sampled)
    shift = len(closing) - len(before)
    spans = [(a + shift, b + shift) for a, b in template.content_spans(messages, tools, True, full) if a >= len(before)]
    return template.encode(closing + full[len(before):], spans)


def last_sampled_run(mask: list[int]) -> int:
    n = 0
    for bit in reversed(mask):
        if not bit:
            break
        n += 1
    return n


class EpisodeStore:
    """Episodes by id (thread-safe: the loop opens and closes them, the server adds turns)."""

    def __init__(self) -> None:
        self._episodes: dict[str, Episode] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()

    def open(self, sampling: SamplingParams, max_turns: int | None = None, token_budget: int | None = None,
             name: str = "ep") -> Episode:
        with self._lock:
            episode = Episode(f"{name}-{next(self._ids)}", sampling, max_turns, token_budget)
            self._episodes[episode.id] = episode
            return episode

    def get(self, episode_id: str) -> Episode | None:
        with self._lock:
            return self._episodes.get(episode_id)

    def close(self, episode_id: str) -> Episode | None:
        """Forget the episode (later calls to it get 404); returns it for its trajectories."""
        with self._lock:
            return self._episodes.pop(episode_id, None)
