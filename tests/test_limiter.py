import pytest

from sleuth.rollout.limiter import KVLimiter


def test_first_samples_reserve_max_tokens():
    lim = KVLimiter(total_blocks=10, block_size=16)
    # 40-token prompt: 2 full blocks shared by the group, 8-token tail + 64 new tokens = 5 own blocks.
    assert lim.sample_blocks(prompt_len=40, max_tokens=64) == 5
    assert lim.try_acquire("a0", "a", 40, 64)
    assert lim.used_blocks == 2 + 5
    assert not lim.try_acquire("a1", "a", 40, 64)  # 7 + 5 > 10
    assert lim.in_flight == 1


def test_prompt_blocks_paid_once_per_group():
    lim = KVLimiter(total_blocks=100, block_size=16)
    for i in range(3):
        assert lim.try_acquire(f"g{i}", "g", 64, 16)
    # 4 shared prompt blocks + 3 x ceil((0 + 16) / 16)
    assert lim.used_blocks == 4 + 3
    lim.release("g0", 10)
    lim.release("g1", 10)
    assert lim.used_blocks == 4 + 1
    lim.release("g2", 10)
    assert lim.used_blocks == 0  # the prompt's blocks go with its last sample


def test_running_mean_widens_admission_after_warmup():
    lim = KVLimiter(total_blocks=20, block_size=16, warmup=4, margin=1.25)
    assert lim.expected_completion(256) == 256
    for i in range(4):
        assert lim.try_acquire(f"s{i}", f"s{i}", 8, 256)  # alone in flight: always admitted
        lim.release(f"s{i}", 20)
    assert lim.mean_completion == 20
    assert lim.expected_completion(256) == 25  # ceil(20 * 1.25)
    assert lim.expected_completion(16) == 16  # never above max_tokens
    # Now each sample needs ceil((8 + 25) / 16) = 3 blocks: 6 fit in 20.
    admitted = sum(lim.try_acquire(f"t{i}", f"t{i}", 8, 256) for i in range(10))
    assert admitted == 6
    assert lim.capacity(8, 256, group_size=1) == 6


def test_aborted_samples_teach_no_length():
    lim = KVLimiter(total_blocks=20, block_size=16, warmup=1)
    lim.try_acquire("x", "x", 8, 100)
    lim.release("x", None)
    assert lim.mean_completion is None
    assert lim.expected_completion(100) == 100


def test_a_sample_larger_than_the_cache_runs_alone():
    lim = KVLimiter(total_blocks=4, block_size=16)
    assert lim.try_acquire("big", "big", 100, 100)  # nothing else in flight: admitted
    assert not lim.try_acquire("small", "small", 4, 4)
    lim.release("big", 100)
    assert lim.try_acquire("small", "small", 4, 4)


def test_max_sequences_caps_admission():
    lim = KVLimiter(total_blocks=1000, block_size=16, max_sequences=3)
    assert [lim.try_acquire(f"s{i}", "g", 16, 16) for i in range(5)] == [True, True, True, False, False]
    assert lim.peak_in_flight == 3
    with pytest.raises(ValueError, match="already in flight"):
        lim.try_acquire("s0", "g", 16, 16)


def test_window_follows_recent_lengths():
    lim = KVLimiter(total_blocks=1000, block_size=16, window=4, warmup=1)
    for i, n in enumerate([100, 100, 100, 100, 10, 10, 10, 10]):
        lim.try_acquire(f"s{i}", "g", 16, 200)
        lim.release(f"s{i}", n)
    assert lim.mean_completion == 10
