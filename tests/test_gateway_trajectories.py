"""Multi-turn episodes through the gateway become training sequences that hold exactly what was sampled."""

import asyncio

import openai
import pytest

from sleuth.gateway.app import Gateway, GatewayServer
from sleuth.gateway.trajectories import EpisodeOutcome, episode_group, sequences
from sleuth.records import Problem, SamplingParams
from sleuth.rewards.advantages import compute_advantages
from sleuth.rollout.hf_engine import HFEngine
from sleuth.testing.scripted import ScriptedEngine
from sleuth.testing.tiny_model import build_tokenizer, write_tiny_model

PROBLEM = Problem("p", [{"role": "user", "content": "play"}], None)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = HFEngine.from_path(str(write_tiny_model(tmp_path_factory.mktemp("tiny"))), "float32", context_len=512)
    yield engine
    engine.close()


async def chat(client, messages, **kw):
    return await client.chat.completions.create(model="policy", messages=messages, logprobs=True,
                                                extra_body={"return_token_ids": True}, **kw)


def test_trained_sequence_holds_exactly_the_sampled_ids_and_engine_logprobs(engine):
    gateway = Gateway(engine, engine.tokenizer)
    with GatewayServer(gateway) as server:
        episode = gateway.store.open(SamplingParams(max_tokens=6, seed=11))

        async def play():
            replies = []
            async with openai.AsyncOpenAI(base_url=server.url(episode.id), api_key="x", max_retries=0) as client:
                messages = [{"role": "user", "content": "play"}]
                for turn in range(3):
                    r = await chat(client, messages)
                    replies.append(r)
                    messages += [r.choices[0].message.model_dump(exclude_none=True),
                                 {"role": "user", "content": f"environment says {turn}"}]
            return replies

        replies = asyncio.run(play())
    [seq] = sequences(episode, reward=0.5)
    full = seq.prompt_ids + seq.completion_ids
    assert seq.prompt_ids == replies[0].model_extra["prompt_token_ids"]
    sampled_ids, sampled_lps = [], []
    for r in replies:
        prompt = r.model_extra["prompt_token_ids"]
        ids = r.choices[0].model_extra["token_ids"]
        assert full[:len(prompt) + len(ids)] == prompt + ids  # each call's prompt extends the last exactly
        sampled_ids += ids
        sampled_lps += [t.logprob for t in r.choices[0].logprobs.content]
    mask = seq.loss_mask
    assert len(mask) == len(seq.completion_ids) == len(seq.logprobs)
    assert [t for t, m in zip(seq.completion_ids, mask) if m] == sampled_ids
    assert [lp for lp, m in zip(seq.logprobs, mask) if m] == sampled_lps
    assert all(lp == 0.0 for lp, m in zip(seq.logprobs, mask) if not m)
    inserted = engine.tokenizer.decode([t for t, m in zip(seq.completion_ids, mask) if not m])
    assert "environment says 0" in inserted and "environment says 1" in inserted
    assert seq.reward == 0.5 and sum(mask) == len(sampled_ids) < len(mask)


def test_branches_and_restarts_become_separate_sequences():
    tok = build_tokenizer()
    engine = ScriptedEngine(tok, ["first", "second", "third"])
    gateway = Gateway(engine, tok)
    with GatewayServer(gateway) as server:
        episode = gateway.store.open(SamplingParams(max_tokens=16))

        async def play():
            async with openai.AsyncOpenAI(base_url=server.url(episode.id), api_key="x", max_retries=0) as client:
                base = [{"role": "user", "content": "go"}]
                r = await chat(client, base, n=2)                      # two choices: "first", "second"
                pick = r.choices[1].message
                await chat(client, [*base, {"role": "assistant", "content": pick.content},
                                    {"role": "user", "content": "more"}])  # extends choice 1
                await chat(client, [{"role": "user", "content": "unrelated"}])  # a new root
        asyncio.run(play())
    seqs = sequences(episode, 1.0)
    texts = [tok.decode(s.completion_ids) for s in seqs]
    assert len(seqs) == 3  # choice 0 (a leaf), choice 1 + its extension, the new root
    assert texts[0] == "first<|im_end|>"
    assert texts[1].startswith("second<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")
    assert seqs[1].prompt_ids == seqs[0].prompt_ids != seqs[2].prompt_ids
    assert engine.prompts[1] == seqs[1].prompt_ids + seqs[1].completion_ids[:len(engine.prompts[1]) - len(seqs[1].prompt_ids)]


def test_every_sequence_takes_its_episodes_advantage():
    tok = build_tokenizer()
    gateway = Gateway(ScriptedEngine(tok, ["a"]), tok)
    with GatewayServer(gateway) as server:
        episodes = [gateway.store.open(SamplingParams(max_tokens=4)) for _ in range(3)]

        async def play(ep, calls):
            async with openai.AsyncOpenAI(base_url=server.url(ep.id), api_key="x", max_retries=0) as client:
                for i in range(calls):
                    await chat(client, [{"role": "user", "content": f"restart {i}"}])
        for ep, calls in zip(episodes, (2, 1, 0)):
            asyncio.run(play(ep, calls))
    outcomes = [EpisodeOutcome(ep, r) for ep, r in zip(episodes, (1.0, 0.0, 0.5))]
    group = episode_group(PROBLEM, outcomes)
    assert group.episode_index == [0, 0, 1] and group.episode_rewards == [1.0, 0.0, 0.5]
    [scored], _ = compute_advantages([group], "dr_grpo")
    assert scored.advantages == [0.5, 0.5, -0.5]  # episode means over 3 episodes (0.5), not 3 sequences
