"""Tool calls in the model's output, in its chat template's format, as OpenAI `tool_calls`.

Format read: Hermes / Qwen (Qwen2.5, Qwen3, Hermes-2/3 and SmolLM templates that follow them) --
each call is a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and
`</tool_call>`; the text outside the tags is the message content. A block whose JSON does not parse
or lacks a name stays in the content (the model gets no call it did not make), and is counted.

The request's `tools` go to the chat template (`apply_chat_template(tools=...)`), which renders
them in the model's own way; a template that ignores tools (the test model's ChatML) still works.
`tool_choice` is accepted ("none" turns parsing off); it does not constrain decoding.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from sleuth.errors import UserError

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """JSON text, as the OpenAI schema carries it."""

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tool_calls(text: str, id_prefix: str) -> tuple[str, list[ToolCall], int]:
    """(content without the parsed blocks, the calls, how many blocks did not parse)."""
    calls: list[ToolCall] = []
    bad = 0
    kept: list[str] = []
    last = 0
    for m in TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name = obj.get("name") if isinstance(obj, dict) else None
            if isinstance(name, str) and name:
                args = obj.get("arguments", obj.get("parameters", {}))
                arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                (name + arguments).encode("utf-8")  # a lone surrogate ("\ud800" in the JSON) is no text
        except (ValueError, RecursionError):  # JSONDecodeError, UnicodeEncodeError; nested too deeply
            name = None
        if not isinstance(name, str) or not name:
            bad += 1
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append(ToolCall(f"{id_prefix}-{len(calls)}", name, arguments))
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return content, calls, bad


def check_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The request's `tools`, checked to the OpenAI shape; UserError names what is wrong."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise UserError("'tools' must be a list")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise UserError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise UserError(f"tools[{i}].function.name must be a non-empty string")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise UserError(f"tools[{i}].function.parameters must be a JSON schema object")
    return tools


def check_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> str:
    """'none', 'auto' or 'required' (a named function counts as required)."""
    if choice is None:
        return "auto" if tools else "none"
    if choice == "required" and not tools:
        raise UserError("tool_choice 'required' needs 'tools'")
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not any(t["function"]["name"] == name for t in tools or []):
            raise UserError(f"tool_choice names function {str(name)[:100]!r}, which is not in 'tools'")
        return "required"
    raise UserError("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")
