"""The mansion grid, the rule checker, time labels, sizes by difficulty, and simulated nights."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from sleuth.tasks.temporal_clue.game import (
    ROOM_NAMES,
    Night,
    Setting,
    check_rules,
    draw_setting,
    draw_size,
    draw_times,
    format_time,
    make_layout,
    simulate_night,
)


def test_layout_of_13_rooms_is_4_by_4_with_three_empty_cells() -> None:
    layout = make_layout(ROOM_NAMES[:13])
    assert (layout.rows, layout.cols) == (4, 4)
    assert layout.room_at(3, 0) == 12 and layout.room_at(3, 1) is None
    assert layout.step(0, "north") is None and layout.step(0, "west") is None
    assert layout.step(0, "south") == 4 and layout.step(0, "east") == 1
    assert layout.step(8, "south") == 12 and layout.step(9, "south") is None
    assert sorted(layout.neighbors(5)) == [1, 4, 6, 9]
    assert sorted(layout.reachable(12)) == [8, 12]
    # Adjacency is symmetric and every edge is one orthogonal step.
    for a, b in layout.edges():
        assert a in layout.neighbors(b)
        (ra, ca), (rb, cb) = layout.cell(a), layout.cell(b)
        assert abs(ra - rb) + abs(ca - cb) == 1


@pytest.mark.parametrize(("minutes", "text"), [(0, "12:00 AM"), (23 * 60 + 45, "11:45 PM"), (25 * 60, "01:00 AM"),
                                               (12 * 60 + 30, "12:30 PM"), (20 * 60, "08:00 PM")])
def test_format_time_matches_published_style(minutes: int, text: str) -> None:
    assert format_time(minutes) == text


def test_draw_times_are_consecutive_and_evening() -> None:
    rng = random.Random(0)
    for count in range(1, 12):
        times = draw_times(rng, count)
        assert len(times) == count == len(set(times))
        assert all(t.endswith(("PM", "AM")) and len(t) == 8 for t in times)


def test_difficulty_one_is_small_and_six_spans_the_published_sizes() -> None:
    rng = random.Random(1)
    small = [draw_size(rng, 1) for _ in range(300)]
    assert {s.suspects for s in small} == {2, 3}
    assert {s.rooms for s in small} <= {2, 3, 4} and {s.times for s in small} == {1, 2}
    big = [draw_size(rng, 6) for _ in range(2000)]
    assert min(s.suspects for s in big) == 2 and max(s.suspects for s in big) == 10
    assert min(s.times for s in big) == 1 and max(s.times for s in big) == 11
    assert max(s.weapons for s in big) == 8 and all(s.rooms >= s.suspects for s in big)


def _night(seed: int, difficulty: int) -> tuple[Setting, Night]:
    rng = random.Random(seed)
    setting = draw_setting(rng, draw_size(rng, difficulty))
    return setting, simulate_night(rng, setting)


@pytest.mark.parametrize("difficulty", [1, 3, 6])
def test_simulated_nights_obey_the_rules(difficulty: int) -> None:
    for seed in range(150):
        setting, night = _night(seed, difficulty)
        assert check_rules(setting, night) == [], (seed, difficulty)
        # The rule checker itself is written from the rule text; spot-check the murder directly.
        t, r = night.time, night.room
        assert night.positions[setting.boddy][t] == r
        assert [s for s in range(setting.num_suspects) if night.positions[s][t] == r] == [night.murderer]
        for tt, s, w in night.carries:  # a carried weapon made its carrier's move
            e = setting.weapon_entity(w)
            assert night.positions[e][tt - 1 : tt + 1] == night.positions[s][tt - 1 : tt + 1]


def test_check_rules_catches_each_kind_of_violation() -> None:
    seed = next(s for s in range(500) if (n := _night(s, 6))[0].num_times >= 3 and n[1].time < n[0].num_times - 1)
    setting, night = _night(seed, 6)
    layout = setting.layout

    def moved(entity: int, t: int, room: int) -> Night:
        positions = [list(p) for p in night.positions]
        positions[entity][t] = room
        return replace(night, positions=positions)

    # A suspect jumping to a non-adjacent room.
    s = next(i for i in range(setting.num_suspects) if i != night.murderer)
    far = next((r for r in range(setting.num_rooms) if r not in layout.reachable(night.positions[s][0])), None)
    if far is not None:
        assert any("jumps" in p for p in check_rules(setting, moved(s, 1, far)))
    # The body moving after the murder.
    b, t = setting.boddy, night.time
    other = layout.neighbors(night.room)[0]
    assert any("body moves" in p for p in check_rules(setting, moved(b, t + 1, other)))
    # Another suspect walking into the murder room at the murder time.
    intruder = next((i for i in range(setting.num_suspects)
                     if i != night.murderer and night.room in layout.reachable(night.positions[i][t])), None)
    if intruder is not None and t == 0:
        assert any("alone" in p for p in check_rules(setting, moved(intruder, t, night.room)))
    # A weapon moving by itself between times 0 and 1 where nobody makes that move.
    w = setting.weapon_entity(0)
    a = night.positions[w][0]
    for dst in layout.neighbors(a):
        if not any(night.positions[i][0] == a and night.positions[i][1] == dst for i in range(setting.num_suspects)):
            positions = [list(p) for p in night.positions]
            positions[w] = [a, dst, *([dst] * (setting.num_times - 2))]
            assert any("moves alone" in p for p in check_rules(setting, replace(night, positions=positions)))
            break
    # With a single time, putting a second suspect in the murder room breaks "alone".
    one = next(s for s in range(500) if _night(s, 3)[0].num_times == 1)
    setting1, night1 = _night(one, 3)
    other_suspect = next(i for i in range(setting1.num_suspects) if i != night1.murderer)
    positions = [list(p) for p in night1.positions]
    positions[other_suspect][0] = night1.room
    assert any("alone" in p for p in check_rules(setting1, replace(night1, positions=positions)))
    # Wrong motive counts.
    if setting.motives:
        assert any("motive" in p for p in check_rules(setting, replace(night, motives=[0] * setting.num_suspects)))
    assert check_rules(setting, replace(night, positions=night.positions[:-1])) == ["positions have the wrong shape"]


def test_simulation_is_deterministic_per_seed() -> None:
    a, b = _night(42, 6), _night(42, 6)
    assert a[0] == b[0] and a[1].positions == b[1].positions and a[1].motives == b[1].motives
