"""The gateway with the real `openai` client over HTTP, on the tiny model (transformers engine)."""

import asyncio
import json

import httpx
import openai
import pytest

from sleuth.gateway.app import Gateway, GatewayServer
from sleuth.records import SamplingParams
from sleuth.rollout.hf_engine import HFEngine
from sleuth.testing.scripted import SCRIPTED_LOGPROB, ScriptedEngine
from sleuth.testing.tiny_model import build_tokenizer, write_tiny_model

MSG = [{"role": "user", "content": "hello"}]
PY = {"type": "function", "function": {"name": "python", "description": "run code",
                                       "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine = HFEngine.from_path(str(write_tiny_model(tmp_path_factory.mktemp("tiny"))), "float32", context_len=256)
    gateway = Gateway(engine, engine.tokenizer, SamplingParams(max_tokens=8))
    with GatewayServer(gateway) as server:
        yield gateway, server
    engine.close()


def call(server, episode=None, **kwargs):
    async def go():
        async with openai.AsyncOpenAI(base_url=server.url(episode), api_key="x", max_retries=0) as client:
            return await client.chat.completions.create(model="policy", **kwargs)
    return asyncio.run(go())


def test_plain_chat_and_models(served):
    gateway, server = served
    r = call(server, messages=MSG, max_tokens=6, seed=1)
    assert r.object == "chat.completion" and len(r.choices) == 1
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    prompt = gateway.template.encode(gateway.template.render(MSG, None, True))
    assert r.usage.prompt_tokens == len(prompt) and 1 <= r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    again = call(server, messages=MSG, max_tokens=6, seed=1)
    assert again.choices[0].message.content == r.choices[0].message.content  # seeded: same draw
    models = httpx.get(server.url() + "/models").json()
    assert [m["id"] for m in models["data"]] == ["policy"]


def test_n_choices_and_logprobs_with_token_ids(served):
    _, server = served
    r = call(server, messages=MSG, max_tokens=5, n=3, logprobs=True, seed=2, extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    total = 0
    for c in r.choices:
        ids = c.model_extra["token_ids"]
        assert len(c.logprobs.content) == len(ids) <= 5
        assert all(t.logprob <= 0 and t.top_logprobs == [] for t in c.logprobs.content)
        total += len(ids)
    assert r.usage.completion_tokens == total
    assert len(r.model_extra["prompt_token_ids"]) == r.usage.prompt_tokens


def test_tools_accepted_by_the_model(served):
    _, server = served
    r = call(server, messages=MSG, tools=[PY], tool_choice="auto", max_tokens=4)
    assert r.choices[0].message.tool_calls is None  # a random model writes no <tool_call> block


def test_tool_call_parsed_from_model_output():
    text = 'Computing.<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>'
    engine = ScriptedEngine(build_tokenizer(), [text])
    with GatewayServer(Gateway(engine, engine.tokenizer)) as server:
        r = call(server, messages=MSG, tools=[PY], logprobs=True)
        off = call(server, messages=MSG, tools=[PY], tool_choice="none")
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Computing."
    assert [(t.type, t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("function", "python", {"code": "print(6*7)"})]
    assert all(t.logprob == SCRIPTED_LOGPROB for t in c.logprobs.content)
    assert off.choices[0].message.content == text and off.choices[0].message.tool_calls is None


def test_errors_in_openai_shape(served):
    _gateway, server = served
    with pytest.raises(openai.BadRequestError) as e:
        call(server, messages=[], max_tokens=4)
    assert e.value.status_code == 400 and "'messages' must be a non-empty list" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="'n' must be an integer"):
        call(server, messages=MSG, n=0)
    raw = httpx.post(server.url() + "/chat/completions", content=b"{nope")
    assert raw.status_code == 400 and raw.json()["error"]["message"] == "the request body is not valid JSON"
    missing = httpx.get(server.url() + "/nowhere")
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError) as e:
        call(server, episode="no-such-episode", messages=MSG)
    assert e.value.body["code"] == "episode_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        call(server, messages=[{"role": "user", "content": "x" * 300}], max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded" and "256 tokens" in e.value.body["message"]


def test_episode_limits(served):
    gateway, server = served
    episode = gateway.store.open(SamplingParams(max_tokens=4, seed=0), max_turns=1)
    call(server, episode.id, messages=MSG)
    with pytest.raises(openai.BadRequestError) as e:
        call(server, episode.id, messages=MSG)
    assert e.value.body["code"] == "max_turns_exceeded"
    episode = gateway.store.open(SamplingParams(max_tokens=50, seed=0), token_budget=3)
    r = call(server, episode.id, messages=MSG)
    assert r.usage.completion_tokens <= 3
    with pytest.raises(openai.BadRequestError) as e:
        call(server, episode.id, messages=MSG)
    assert e.value.body["code"] == "token_budget_exceeded"
    gateway.store.close(episode.id)
    with pytest.raises(openai.NotFoundError):
        call(server, episode.id, messages=MSG)


def test_serving_on_the_callers_event_loop(served):
    """GatewayServer.serving(): the same API on the running loop, the run's signal handlers kept,
    and the port closed when the block ends."""
    import signal

    gateway, _ = served
    server = GatewayServer(gateway)
    handler = signal.getsignal(signal.SIGTERM)

    async def go():
        before = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
        async with server.serving():
            port = server.port
            assert port != 0 and [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == before
            episode = gateway.store.open(SamplingParams(max_tokens=4, seed=3))
            async with openai.AsyncOpenAI(base_url=server.url(episode.id), api_key="x", max_retries=0) as client:
                r = await client.chat.completions.create(model="policy", messages=MSG, max_tokens=4)
            assert len(gateway.store.close(episode.id).turns) == 1
        return port, r

    port, r = asyncio.run(go())
    assert r.choices[0].finish_reason in ("stop", "length")
    assert signal.getsignal(signal.SIGTERM) is handler
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
