"""Both rollout engines behind the same tests, on the tiny fp32 model.

vLLM tests skip only where vLLM is not installed (the reason is printed by -ra); in CI they run.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import threading
import time

import pytest
import torch

from sleuth.config import RolloutConfig
from sleuth.errors import ConfigError, UserError
from sleuth.records import LoraAdapter, SamplingParams
from sleuth.rollout import factory
from sleuth.rollout.base import (
    GenerationRequest,
    RolloutTimeoutError,
    moving_average_below,
)
from sleuth.rollout.factory import make_engine
from sleuth.rollout.limiter import KVLimiter

HAS_VLLM = importlib.util.find_spec("vllm") is not None
CONTEXT = 256
LOGPROB_TOL = 1e-4
"""Stated tolerance: engine logprobs vs a transformers forward of the same fp32 model (max abs)."""

ENGINES = [
    "hf",
    pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.slow,
                                pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")]),
]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engines(model_dir):
    """Each engine built once for the module (vLLM's start-up is the expensive part)."""
    built = {}

    def get(kind: str):
        if kind not in built:
            # A small KV cache (2 MiB: 16 blocks of 128 tokens for vLLM) so the limiter has work to do.
            # Both serve LoRA adapters: vLLM with its own LoRA layers, hf by applying B @ A to its weights.
            cfg = RolloutConfig(engine=kind, max_model_len=CONTEXT, kv_cache_gb=0.002, timeout_s=120,
                                native_lora=kind == "vllm")
            built[kind] = make_engine(cfg, str(model_dir), "float32", seed=0)
        return built[kind]

    yield get
    for eng in built.values():
        eng.close()


@pytest.fixture(params=ENGINES)
def engine(request, engines):
    return engines(request.param)


def prompt(n: int, start: int = 10) -> list[int]:
    return [(start + 7 * i) % 250 for i in range(n)]


def req(n: int = 4, max_tokens: int = 16, seed: int | None = 1, plen: int = 40, rid: str = "", **kw) -> GenerationRequest:
    return GenerationRequest(prompt(plen, start=seed or 0), n, SamplingParams(max_tokens=max_tokens, seed=seed, **kw),
                             rid)


def forward_logprobs(model, prompt_ids: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + completion])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def tokens_of(results) -> list[list[int]]:
    return [s.token_ids for r in results for s in r.samples]


# ---------------------------------------------------------------- behaviour


def test_shapes_and_finish_reasons(engine):
    eos = 258
    stops = ("a", "e", "o")
    results = engine.generate_all([req(3, 12, seed=1, rid="plain"), req(8, 64, seed=2, stop=stops, rid="stops")])
    assert [r.request.request_id for r in results] == ["plain", "stops"]
    assert [len(r.samples) for r in results] == [3, 8]
    for r in results:
        for s in r.samples:
            max_tokens = r.request.sampling.max_tokens
            assert 1 <= len(s.token_ids) <= max_tokens
            assert len(s.logprobs) == len(s.token_ids)
            assert all(lp <= 0 for lp in s.logprobs)
            assert eos not in s.token_ids[:-1]  # EOS ends a sample
            assert s.time_s > 0
            if s.finish_reason == "length":
                assert len(s.token_ids) == max_tokens and s.token_ids[-1] != eos
            else:
                assert s.finish_reason == "stop"
                assert s.token_ids[-1] == eos or s.text.endswith(r.request.sampling.stop)
    stop_samples = [s for s in results[1].samples if s.finish_reason == "stop"]
    assert stop_samples, "with 3 single-letter stop strings over 64 tokens some sample stops"
    for s in stop_samples:
        if s.token_ids[-1] != 258:  # stopped on a string: it is in the text, once, at the end
            assert sum(s.text.count(c) for c in stops) == 1


def test_seed_determinism(engine):
    requests = [req(4, 20, seed=5, rid="a"), req(4, 20, seed=6, rid="b")]
    first, second = engine.generate_all(requests), engine.generate_all(requests)
    assert tokens_of(first) == tokens_of(second)
    a, b = tokens_of(first)[:4], tokens_of(first)[4:]
    assert a != b
    assert len({tuple(t) for t in a}) > 1  # the n samples of a group differ


def test_logprobs_match_forward(engine, reference):
    results = engine.generate_all([req(4, 24, seed=3, plen=60), req(2, 24, seed=None, temperature=0.0, plen=30)])
    for r in results:
        for s in r.samples:
            ref = forward_logprobs(reference, r.request.prompt_ids, s.token_ids)
            assert torch.allclose(torch.tensor(s.logprobs), ref, atol=LOGPROB_TOL, rtol=0)
    # Greedy: every token is the argmax of the forward pass, and both greedy samples agree.
    greedy = results[1].samples
    assert greedy[0].token_ids == greedy[1].token_ids
    ids = torch.tensor([results[1].request.prompt_ids + greedy[0].token_ids])
    with torch.no_grad():
        logits = reference(ids).logits[0, 29:-1]
    assert logits.argmax(-1).tolist() == greedy[0].token_ids


def test_weight_sync_changes_then_restores(engine, reference):
    request = [req(4, 20, seed=7)]
    before = engine.generate_all(request)
    original = [(n, p.detach().clone()) for n, p in reference.named_parameters()]
    # Zero output head: every logit is 0, so every token has logprob exactly -log(vocab).
    changed = [(n, torch.zeros_like(t) if n == "lm_head.weight" else t) for n, t in original]
    engine.sync_weights(changed)
    after = engine.generate_all(request)
    lps = torch.tensor([lp for s in after[0].samples for lp in s.logprobs])
    assert torch.allclose(lps, torch.full_like(lps, -math.log(272)), atol=1e-5)
    assert tokens_of(after) != tokens_of(before)
    engine.sync_weights(original)
    restored = engine.generate_all(request)
    assert tokens_of(restored) == tokens_of(before)
    assert torch.allclose(torch.tensor(restored[0].samples[0].logprobs), torch.tensor(before[0].samples[0].logprobs),
                          atol=LOGPROB_TOL)


def test_sync_weights_after_prefix_cache_use(engine, reference):
    # A prompt longer than a KV block: vLLM caches its blocks; after a sync, stale cached KV
    # would give the old model's logprobs for the new weights.
    long_req = [req(2, 8, seed=9, plen=200, temperature=0.0)]  # greedy, as the issue states it
    engine.generate_all(long_req)
    original = [(n, p.detach().clone()) for n, p in reference.named_parameters()]
    scaled = [(n, t * 1.5 if "v_proj" in n else t) for n, t in original]
    try:
        engine.sync_weights(scaled)
        out = engine.generate_all(long_req)[0].samples[0]
        changed = reference.__class__(reference.config).eval()
        changed.load_state_dict(dict(scaled), strict=False)
        ref = forward_logprobs(changed, long_req[0].prompt_ids, out.token_ids)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=LOGPROB_TOL, rtol=0)
    finally:
        engine.sync_weights(original)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_vllm_weight_update_in_flight_resumes_samples_with_the_new_weights(engines, reference):
    """loop.streaming's partial rollouts in vLLM: a sync during a generation lands between two engine
    steps (the generation does not finish first); each sample in flight keeps its tokens so far
    (the old weights' logprobs) and goes on with the new weights, its KV cache recomputed by them
    (every later logprob equals a transformers forward of the new weights over the whole sequence),
    and its tokens carry both versions."""
    engine = engines("vllm")
    original = [(n, p.detach().clone()) for n, p in reference.named_parameters()]
    scaled = [(n, t * 1.5 if "v_proj" in n else t) for n, t in original]
    request = req(4, 120, seed=11, plen=40)
    started = threading.Event()

    def slow_process(outputs, active):  # a few ms a step, and a signal once tokens are out
        type(engine)._process(engine, outputs, active)
        time.sleep(0.01)
        if any(len(a.tokens) >= 8 for a in active.values()):
            started.set()

    engine._process = slow_process
    engine.in_flight_updates, engine.policy_version = True, 0
    partial_before = engine.stats()["partial"]
    try:
        results = []
        gen = threading.Thread(target=lambda: results.append(engine.generate_all([request])))
        gen.start()
        assert started.wait(60)
        engine.sync_weights(scaled)
        engine.policy_version = 1  # as WeightSync.snapshot's push does once the weights are sent
        finished_before_the_sync_returned = bool(results)
        gen.join(120)
        assert not finished_before_the_sync_returned and results
        assert engine.stats()["partial"] > partial_before
        new_model = reference.__class__(reference.config).eval()
        new_model.load_state_dict(dict(scaled), strict=False)
        resumed = 0
        for s in results[0][0].samples:
            assert s.token_versions is not None and len(s.token_versions) == len(s.token_ids)
            if s.token_versions[-1] != 1:
                continue
            resumed += 1
            lps = torch.tensor(s.logprobs)
            old = (lps - forward_logprobs(reference, request.prompt_ids, s.token_ids)).abs() <= LOGPROB_TOL
            new = (lps - forward_logprobs(new_model, request.prompt_ids, s.token_ids)).abs() <= LOGPROB_TOL
            switch = int(torch.cumprod(old.int(), 0).sum())  # tokens before it: the old weights'
            assert switch >= 8 and bool(new[switch:].all()), (switch, new.int().tolist())
            assert set(s.token_versions[:switch]) == {0}  # never labelled newer than its weights
        assert resumed >= 1
    finally:
        del engine._process
        engine.in_flight_updates, engine.policy_version = False, 0
        engine.sync_weights(original)


def test_release_memory_then_generation_is_unchanged(engine):
    # The loop releases the engine's memory before each training step (the engine idles until the
    # sync). vLLM on CPU gives its KV cache's pages back; the next rollout must be exactly as before.
    long_req = [req(2, 8, seed=5, plen=200, temperature=0.0)]
    before = engine.generate_all(long_req)  # fills the prefix cache with this prompt's blocks
    released = engine.release_memory()
    if type(engine).__name__ == "VLLMEngine":
        assert released >= 0.9 * 0.002 * 2**30  # the whole KV cache (rollout.kv_cache_gb), in pages
    else:
        assert released == 0  # the hf engine keeps no cache between rollouts
    after = engine.generate_all(long_req)
    assert tokens_of(after) == tokens_of(before)
    assert [s.logprobs for s in after[0].samples] == [s.logprobs for s in before[0].samples]
    assert engine.release_memory() == released  # again, after a rollout touched pages anew


def test_sync_lora_merges_adapter(engine, reference):
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, mod in reference.named_modules():
        if name.endswith(("q_proj", "v_proj")):
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(4, mod.in_features, generator=gen) * 0.2
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(mod.out_features, 4, generator=gen) * 0.2
    adapter = LoraAdapter(tensors, rank=4, alpha=8.0)
    merged = {n: p.detach().clone() for n, p in reference.named_parameters()}
    for name, delta in adapter.deltas().items():
        merged[name] += delta
    request = [req(2, 16, seed=11)]
    before = tokens_of(engine.generate_all(request))
    assert engine.native_lora
    engine.sync_lora(adapter)
    try:
        out = engine.generate_all(request)[0].samples[0]
        lora_model = reference.__class__(reference.config).eval()
        lora_model.load_state_dict(merged, strict=False)
        ref = forward_logprobs(lora_model, request[0].prompt_ids, out.token_ids)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=LOGPROB_TOL, rtol=0)
        # A second sync replaces the adapter in place.
        engine.sync_lora(LoraAdapter({k: v * 0.5 for k, v in tensors.items()}, rank=4, alpha=8.0))
        assert tokens_of(engine.generate_all(request))[0] != out.token_ids
    finally:
        engine.sync_lora(None)
    assert tokens_of(engine.generate_all(request)) == before


def test_stream_yields_each_group_as_it_finishes(engine):
    requests = [req(4, 120, seed=1, rid="long"), req(2, 2, seed=2, rid="short")]

    async def collect() -> list[str]:
        return [r.request.request_id async for r in engine.stream(requests)]

    assert asyncio.run(collect()) == ["short", "long"]


def test_early_stop_aborts_degenerate_samples(engine):
    # The random tiny model's tokens have logprob about -5.6: the moving average from 0 crosses
    # -3 after ~95 tokens, never -50.
    before = engine.stats()["aborted"]
    engine.early_stop_logprob = -3.0
    try:
        out = engine.generate_all([req(4, 180, seed=13, plen=20)])[0].samples
    finally:
        engine.early_stop_logprob = None
    aborted = [s for s in out if s.finish_reason == "abort"]
    assert aborted
    assert engine.stats()["aborted"] - before == len(aborted)
    for s in aborted:
        # aborted at exactly the token where the average first fell below the threshold
        assert moving_average_below(s.logprobs, -3.0)[0]
        assert not moving_average_below(s.logprobs[:-1], -3.0)[0]
    engine.early_stop_logprob = -50.0
    try:
        out = engine.generate_all([req(4, 180, seed=13, plen=20)])[0].samples
    finally:
        engine.early_stop_logprob = None
    assert all(s.finish_reason != "abort" for s in out)


def test_generation_timeout_names_the_step(engine):
    engine.timeout_s = 0.001
    try:
        with pytest.raises(RolloutTimeoutError, match=r"generation of request slow did not finish within 0.001 s"):
            engine.generate_all([req(8, 200, seed=1, plen=20, rid="slow")])
    finally:
        engine.timeout_s = 120
    # The engine drops the abandoned request and keeps serving.
    assert len(engine.generate_all([req(2, 4)])[0].samples) == 2


def test_sync_timeout_names_the_step(engine, reference):
    # Simulate a stuck engine step: occupy the model's thread for a second.
    blocker = threading.Thread(target=engine._call, args=(lambda: time.sleep(1.0), "blocker"))
    blocker.start()
    time.sleep(0.1)
    engine.timeout_s = 0.05
    try:
        with pytest.raises(RolloutTimeoutError, match=r"weight sync \(sync_weights\) did not finish within 0.05 s"):
            engine.sync_weights([(n, p.detach()) for n, p in reference.named_parameters()])
    finally:
        engine.timeout_s = 120
        blocker.join()


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (GenerationRequest([], 2), "empty prompt"),
        (GenerationRequest([1, 2], 2, SamplingParams(max_tokens=0)), "max_tokens must be >= 1, got 0"),
        (GenerationRequest(prompt(CONTEXT), 1), "prompt of 256 tokens leaves no room in the engine's context of 256"),
        (GenerationRequest([1, 2], 0), "n must be >= 1"),
        (GenerationRequest([1, 999], 1), "token id 999 outside the vocabulary"),
        (GenerationRequest([1, 2], 1, SamplingParams(top_p=0.0)), "top_p must be in"),
    ],
)
def test_bad_requests_rejected(engine, request_, message):
    with pytest.raises(UserError, match=message):
        engine.generate_all([request_])


def test_many_long_prompts_in_one_step(engine):
    # 3 groups x 8 samples of 200-token prompts: more prompt tokens than vLLM's per-step budget
    # (2048), which on CPU once crashed seeded sampling inside chunked prefill.
    out = engine.generate_all([req(8, 4, seed=30 + i, plen=200) for i in range(3)])
    assert [len(r.samples) for r in out] == [8, 8, 8]
    assert all(len(s.token_ids) == 4 or s.finish_reason == "stop" for r in out for s in r.samples)


def test_completion_capped_at_context(engine):
    s = engine.generate_all([GenerationRequest(prompt(CONTEXT - 3), 1, SamplingParams(max_tokens=50, seed=1))])
    sample = s[0].samples[0]
    assert len(sample.token_ids) <= 3
    assert sample.finish_reason in ("length", "stop")


# ---------------------------------------------------------------- engine specifics


def test_hf_prefills_each_prompt_once(model_dir):
    eng = make_engine(RolloutConfig(engine="hf"), str(model_dir), "float32", seed=0)
    eng.generate_all([req(8, 4, seed=1, plen=40), req(6, 4, seed=2, plen=25)])
    assert eng.stats()["prefill_tokens"] == 40 + 25  # not 8 * 40 + 6 * 25
    eng.close()


def test_hf_shared_prompt_decoding_equals_a_repeated_cache(model_dir, monkeypatch):
    import sleuth.rollout.shared_prefix as shared_prefix

    monkeypatch.setattr(shared_prefix, "INITIAL_SLOTS", 4)  # so the own-token slots must grow
    eng = make_engine(RolloutConfig(engine="hf"), str(model_dir), "float32", seed=0)
    assert eng.shared_prefix
    # Prompts of different lengths (left padding) and stop strings (rows end at different steps,
    # so finished rows are dropped from the batch mid-way).
    requests = [req(8, 20, seed=1, plen=40, stop=("a", "e")), req(6, 20, seed=2, plen=25), req(3, 9, seed=3, plen=7)]
    shared = eng.generate_all(requests)
    eng.shared_prefix = False
    repeated = eng.generate_all(requests)
    eng.close()
    assert tokens_of(shared) == tokens_of(repeated)
    assert len({len(t) for t in tokens_of(shared)}) > 1
    for a, b in zip(shared, repeated):
        for x, y in zip(a.samples, b.samples):
            assert x.finish_reason == y.finish_reason
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)


def test_hf_engine_switches_a_plain_sdpa_model_to_shared_prompt_decoding(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sleuth.rollout.hf_engine import HFEngine

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    eng = HFEngine(model, AutoTokenizer.from_pretrained(model_dir))
    assert eng.shared_prefix and model.config._attn_implementation == "sleuth_packed"
    eager = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    assert not HFEngine(eager, AutoTokenizer.from_pretrained(model_dir)).shared_prefix
    eng.close()


def test_hf_top_p_keeps_the_nucleus(model_dir):
    # top_p tiny: only the most likely token survives, so sampling equals greedy decoding.
    eng = make_engine(RolloutConfig(engine="hf"), str(model_dir), "float32", seed=0)
    greedy, nucleus = eng.generate_all([req(1, 12, seed=1, temperature=0.0), req(3, 12, seed=1, top_p=1e-6)])
    assert all(s.token_ids == greedy.samples[0].token_ids for s in nucleus.samples)
    eng.close()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_vllm_limiter_prevents_preemption(engines):
    eng = engines("vllm")
    # Read from vLLM's cache config: 16 blocks of 128 tokens, one kept aside by vLLM.
    assert (eng.limiter.total_blocks, eng.limiter.block_size) == (15, 128)
    # 3 groups x 8 samples of 120 + 20 tokens: each crosses into a second block while decoding,
    # 48 blocks in all for a cache of 15.
    many = [req(8, 20, seed=20 + i, plen=120) for i in range(3)]
    start = eng.stats()
    eng.limiter.peak_in_flight = 0
    eng.generate_all(many)
    end = eng.stats()
    assert end["preemptions"] == start["preemptions"]
    assert eng.limiter.peak_in_flight <= 7  # the limiter held samples back: 2 blocks each
    # Without the limiter vLLM must preempt to fit them all, and the counter sees it.
    saved = eng.limiter
    eng.limiter = KVLimiter(10**6, saved.block_size)
    try:
        again = eng.generate_all(many)
    finally:
        eng.limiter = saved
    assert eng.stats()["preemptions"] > end["preemptions"]
    assert [len(r.samples) for r in again] == [8] * 3
    # Prefix caching: the 8 samples of a group share the prompt's full block (140 > 128 tokens).
    hits = eng.stats()["prefix_hits"]
    eng.generate_all([req(8, 4, seed=40, plen=140)])
    assert eng.stats()["prefix_hits"] - hits >= 7 * 128


def test_factory_choices(model_dir, monkeypatch):
    from sleuth.rollout.hf_engine import HFEngine

    monkeypatch.setattr(factory, "vllm_available", lambda: False)
    eng = make_engine(RolloutConfig(engine="auto"), str(model_dir), "float32", seed=0)
    assert isinstance(eng, HFEngine)
    eng.close()
    with pytest.raises(ConfigError, match=r"rollout\.engine=vllm but vLLM is not installed"):
        make_engine(RolloutConfig(engine="vllm"), str(model_dir), "float32", seed=0)


def test_adapter_folder_is_a_peft_adapter(tmp_path, reference):
    # The folder vLLM's native LoRA path loads: PEFT must read it back to the same merged weights.
    from peft import PeftModel

    from sleuth.rollout.vllm_weights import write_adapter

    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for name, mod in reference.named_modules():
        if name.endswith("v_proj"):
            tensors[f"base_model.model.{name}.lora_A.default.weight"] = torch.randn(2, mod.in_features, generator=gen)
            tensors[f"base_model.model.{name}.lora_B.default.weight"] = torch.randn(mod.out_features, 2, generator=gen)
    adapter = LoraAdapter(tensors, rank=2, alpha=4.0)
    folder = write_adapter(adapter, tmp_path / "adapter", "tiny")
    base = reference.__class__(reference.config)
    base.load_state_dict(reference.state_dict())
    merged = PeftModel.from_pretrained(base, folder).merge_and_unload().state_dict()
    deltas = adapter.deltas()
    assert set(deltas) == {n for n in merged if n.endswith("v_proj.weight")}
    for name, p in reference.state_dict().items():
        expected = p + deltas[name] if name in deltas else p
        assert torch.allclose(merged[name], expected, atol=1e-5), name


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_vllm_step_failure_reaches_callers(engines):
    # Keep this test last in the file: it leaves the module's vLLM engine stopped.
    eng = engines("vllm")

    def broken_step():
        raise RuntimeError("simulated engine failure")

    eng._engine.step = broken_step
    with pytest.raises(RuntimeError, match="simulated engine failure"):
        eng.generate_all([req(2, 4), req(2, 4, seed=2)])
    with pytest.raises(RuntimeError, match="VLLMEngine stopped after an error"):
        eng.generate_all([req(2, 4)])
    with pytest.raises(RuntimeError, match="VLLMEngine stopped after an error"):
        eng.sync_weights([])


def test_vllm_refusal_reason_is_one_line_with_its_cause() -> None:
    """A validation error whose first line is only a heading keeps the line that says why."""
    from sleuth.rollout.vllm_weights import load_error

    heading = ValueError("Class validation error for validator 'validate_layer_type':\n"
                         "    ValueError: The `mlp_layer_types` entries must be in ('sparse', 'dense')\n  more")
    assert load_error(heading) == ("ValueError: Class validation error for validator 'validate_layer_type': "
                                    "ValueError: The `mlp_layer_types` entries must be in ('sparse', 'dense')")
    assert load_error(KeyError("q_proj")) == "KeyError: 'q_proj'"

