"""Weight sync: adapter-only for LoRA on an engine that serves adapters, full weights otherwise."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from sleuth.config import LoraConfig, ModelConfig
from sleuth.records import LoraAdapter
from sleuth.rollout.base import RolloutEngine
from sleuth.rollout.hf_engine import HFEngine
from sleuth.rollout.sync import InProcessTransport, WeightSync, choose_mode, pack_buckets, unpack
from sleuth.system.attention import PACKED, register_packed_attention
from sleuth.testing.tiny_model import build_model, build_tokenizer
from sleuth.train.policy import Policy


def make_pair(lora: bool) -> tuple[Policy, HFEngine]:
    """A policy and an engine on separate copies of the same tiny model; the policy then moves."""
    register_packed_attention()
    cfg = ModelConfig(path="unused", dtype="float32", lora=LoraConfig(enabled=lora, rank=4, alpha=8.0))
    policy = Policy(build_model(hidden=32, layers=2, heads=4, kv_heads=2, seed=3), build_tokenizer(), cfg,
                    need_reference=False, device="cpu")
    engine_model = build_model(hidden=32, layers=2, heads=4, kv_heads=2, seed=3).eval()
    engine_model.set_attn_implementation(PACKED)
    engine = HFEngine(engine_model, build_tokenizer(), model_path="tiny")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # an "update": LoRA B (zero at init) or every weight moves
        for p in policy.trainable_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return policy, engine


def assert_engine_matches(policy: Policy, engine: HFEngine) -> None:
    params = dict(engine.model.named_parameters())
    for name, t in policy.sync_state():
        torch.testing.assert_close(params[name], t, rtol=1e-5, atol=1e-6)


def full_bytes(policy: Policy) -> int:
    return sum(t.numel() * t.element_size() for _, t in policy.sync_state())


def test_lora_on_an_adapter_engine_sends_only_the_adapter() -> None:
    policy, engine = make_pair(lora=True)
    try:
        assert choose_mode(policy, engine) == "adapter"
        sync = WeightSync(policy, engine)
        stats = sync.push()
        assert stats.mode == "adapter"
        assert stats.bytes == policy.lora_adapter().nbytes
        assert 0 < stats.bytes < full_bytes(policy) / 5
        assert_engine_matches(policy, engine)
        # A second update replaces the first adapter (not added on top of it).
        with torch.no_grad():
            for p in policy.trainable_parameters():
                p.mul_(-0.5)
        sync.push()
        assert_engine_matches(policy, engine)
        m = stats.metrics()
        assert m["sync/adapter"] == 1.0 and m["sync/bytes"] == stats.bytes and m["time/sync_s"] >= 0
    finally:
        engine.close()


def test_full_weights_without_lora_or_when_asked() -> None:
    policy, engine = make_pair(lora=False)
    try:
        stats = WeightSync(policy, engine).push()
        assert stats.mode == "full" and stats.bytes == full_bytes(policy)
        assert_engine_matches(policy, engine)
    finally:
        engine.close()
    policy, engine = make_pair(lora=True)
    try:
        stats = WeightSync(policy, engine, mode="full").push()
        assert stats.mode == "full" and stats.bytes == full_bytes(policy)
        assert_engine_matches(policy, engine)
    finally:
        engine.close()


class CountingTransport(InProcessTransport):
    """A transport of our own: the seam a Ray or NCCL transport plugs into."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def send_full(self, engine: RolloutEngine, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        self.calls.append("full")
        return super().send_full(engine, tensors)

    def send_adapter(self, engine: RolloutEngine, adapter: LoraAdapter) -> int:
        self.calls.append(f"adapter r={adapter.rank}")
        return super().send_adapter(engine, adapter)


def test_a_transport_plugs_in() -> None:
    policy, engine = make_pair(lora=True)
    transport = CountingTransport()
    try:
        WeightSync(policy, engine, transport=transport).push()
        WeightSync(policy, engine, transport=transport, mode="full").push()
        assert transport.calls == ["adapter r=4", "full"]
        assert_engine_matches(policy, engine)
    finally:
        engine.close()


def test_a_snapshot_pushes_the_weights_of_when_it_was_taken() -> None:
    """Overlapped rollouts: the trainer moves on before the engine is free; the engine must get
    the weights of the snapshot, not the ones the trainer holds by the time of the push."""
    for lora, mode in ((True, "adapter"), (False, "full"), (True, "full")):
        policy, engine = make_pair(lora=lora)
        try:
            sync = WeightSync(policy, engine, mode=mode)
            expected = [(n, t.clone()) for n, t in policy.sync_state()]
            push = sync.snapshot()
            with torch.no_grad():  # the next update, before the push
                for p in policy.trainable_parameters():
                    p.add_(1.0)
            stats = push()
            assert stats.mode == mode and stats.bytes > 0
            params = dict(engine.model.named_parameters())
            for name, t in expected:
                torch.testing.assert_close(params[name], t, rtol=1e-5, atol=1e-6)
        finally:
            engine.close()


def test_ray_buckets_round_trip_any_dtype():
    tensors = [("a", torch.randn(3, 5)), ("b", torch.randn(7).to(torch.bfloat16)), ("c", torch.arange(4)),
               ("d", torch.randn(2, 2).t())]  # non-contiguous
    buckets = pack_buckets(tensors, bucket_mb=100 / 1024**2)  # 100 bytes: several buckets
    assert len(buckets) > 1
    back = [nt for b in buckets for nt in unpack(b)]
    assert [n for n, _ in back] == ["a", "b", "c", "d"]
    for (_, want), (_, got) in zip(tensors, back):
        assert got.dtype == want.dtype and torch.equal(got, want)
