import pytest

from sleuth.gateway.protocol import GatewayError, cut_at_stop, parse_chat_request

MSG = [{"role": "user", "content": "hi"}]


def test_fields_parsed_with_defaults():
    r = parse_chat_request({"model": "x", "messages": MSG, "max_completion_tokens": 7, "max_tokens": 3, "n": 2,
                            "stop": "END", "temperature": 0, "seed": 5, "logprobs": True, "top_logprobs": 0,
                            "user": "ignored"})
    assert (r.max_tokens, r.n, r.stop, r.temperature, r.seed, r.logprobs) == (7, 2, ("END",), 0, 5, True)
    r = parse_chat_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}]}]})
    assert (r.n, r.max_tokens, r.temperature, r.stop, r.tool_choice) == (1, None, None, (), "none")
    assert r.messages == [{"role": "user", "content": "ab"}]


@pytest.mark.parametrize("body, message", [
    ([], "must be a JSON object"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "needs a 'role'"),
    ({"messages": MSG, "n": 0}, "'n' must be an integer"),
    ({"messages": MSG, "n": True}, "'n' must be an integer"),
    ({"messages": MSG, "temperature": 3}, "'temperature' must be a number"),
    ({"messages": MSG, "top_p": 0}, "'top_p' must be"),
    ({"messages": MSG, "max_tokens": "9"}, "'max_tokens' must be an integer"),
    ({"messages": MSG, "stop": ["", "x"]}, "'stop' must be"),
    ({"messages": MSG, "stream": "yes"}, "'stream' must be true or false"),
    ({"messages": MSG, "top_logprobs": 2}, "'top_logprobs' > 0 is not supported"),
    ({"messages": MSG, "logprobs": "yes"}, "'logprobs' must be true or false"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "no images"),
])
def test_malformed_requests_name_the_field(body, message):
    with pytest.raises(GatewayError, match=message) as e:
        parse_chat_request(body)
    assert e.value.status == 400 and e.value.body()["error"]["type"] == "invalid_request_error"


def test_stop_strings_cut_the_text():
    assert cut_at_stop("a END b STOP", ("STOP", "END")) == "a "
    assert cut_at_stop("abc", ("x",)) == "abc"
