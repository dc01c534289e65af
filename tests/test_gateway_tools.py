import json

import pytest

from sleuth.errors import UserError
from sleuth.gateway.tools import check_tool_choice, check_tools, parse_tool_calls

PY = {"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}


def test_hermes_tool_calls_parsed_and_removed_from_content():
    text = ('Let me compute.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(1+1)"}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    content, calls, bad = parse_tool_calls(text, "c")
    assert content == "Let me compute."
    assert [(c.id, c.name, json.loads(c.arguments)) for c in calls] == [
        ("c-0", "python", {"code": "print(1+1)"}), ("c-1", "add", {"a": 1})]
    assert bad == 0
    assert calls[0].openai()["function"]["arguments"] == '{"code": "print(1+1)"}'


def test_malformed_blocks_stay_in_the_content_and_are_counted():
    text = "<tool_call>{not json}</tool_call> and <tool_call>{\"arguments\": {}}</tool_call>"
    content, calls, bad = parse_tool_calls(text, "c")
    assert (content, calls, bad) == (text, [], 2)
    assert parse_tool_calls("plain answer", "c") == ("plain answer", [], 0)


def test_tools_and_tool_choice_checked():
    assert check_tools([PY]) == [PY]
    assert check_tools(None) is None
    assert check_tool_choice(None, [PY]) == "auto"
    assert check_tool_choice(None, None) == "none"
    assert check_tool_choice({"type": "function", "function": {"name": "python"}}, [PY]) == "required"
    for bad, message in [("x", "must be a list"), ([{"type": "function"}], r"tools\[0\] must be"),
                         ([{"type": "function", "function": {"name": ""}}], "name must be a non-empty")]:
        with pytest.raises(UserError, match=message):
            check_tools(bad)
    with pytest.raises(UserError, match="not in 'tools'"):
        check_tool_choice({"type": "function", "function": {"name": "nope"}}, [PY])
    with pytest.raises(UserError, match="'tool_choice' must be"):
        check_tool_choice("sometimes", [PY])
