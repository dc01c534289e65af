"""The CP-SAT model against the plain-Python rules and clue semantics, and the clue selection
against an independent brute-force enumeration of every possible night (tiny puzzles)."""

from __future__ import annotations

import random
from dataclasses import replace
from itertools import permutations, product

from ortools.sat.python import cp_model

from sleuth.tasks.temporal_clue.clues import Clue
from sleuth.tasks.temporal_clue.game import (
    Night,
    Setting,
    check_rules,
    draw_setting,
    draw_size,
    simulate_night,
)
from sleuth.tasks.temporal_clue.generate import Drafter, _draw, build_puzzle, candidate_clues
from sleuth.tasks.temporal_clue.solver import GameModel, nearby_nights

FORMS = ("fact", "not", "or", "either", "iff", "if_then")
KINDS = ("at", "same", "beside", "together", "moved", "moved_weapon", "motive", "murder", "never", "count")


def _fix(model: GameModel, night: Night) -> None:
    s = model.setting
    for e in range(s.num_entities):
        for t in range(s.num_times):
            model.model.add(model.x[e][t][night.room_of(e, t)] == 1)
    for var in (model.murderer[night.murderer], model.weapon[night.weapon], model.room[night.room],
                model.time[night.time]):
        model.model.add(var == 1)
    for i, k in enumerate(night.motives):
        model.model.add(model.motive_vars[i][k] == 1)


def _random_clues(rng: random.Random, setting: Setting, night: Night, n: int) -> list[Clue]:
    """Clues of every form and kind, true or false of `night`."""
    drafter = Drafter(rng, setting, night)
    out: list[Clue] = []
    while len(out) < n:
        form = rng.choice(FORMS)
        atoms = [_draw(drafter, rng.choice(KINDS), rng.random() < 0.5) for _ in range(1 if form in ("fact", "not") else 2)]
        if all(a is not None for a in atoms) and (form != "not" or atoms[0].kind in ("at", "same_room")):
            out.append(Clue(form, tuple(atoms)))  # type: ignore[arg-type]
    return out


def test_every_clue_encoding_agrees_with_its_python_meaning() -> None:
    checked = 0
    for seed in range(12):
        rng = random.Random(seed)
        setting = draw_setting(rng, draw_size(rng, 6 if seed % 2 else 3))
        drawn_on = simulate_night(rng, setting)
        # Evaluate on the night the clues were drawn from and on an unrelated night of the same setting,
        # so both truth values of every form get exercised.
        for night in (drawn_on, simulate_night(rng, setting)):
            clues = _random_clues(random.Random(seed), setting, drawn_on, 120)
            model = GameModel(setting)
            lits = [c.encode(model) for c in clues]
            _fix(model, night)
            solver = cp_model.CpSolver()
            solver.parameters.num_workers = 1
            assert solver.solve(model.model) in (cp_model.OPTIMAL, cp_model.FEASIBLE), "a true night was rejected"
            for clue, lit in zip(clues, lits):
                assert solver.boolean_value(lit) == clue.holds(setting, night), clue.text(setting)
                checked += 1
    assert checked == 12 * 2 * 120


def test_model_solutions_obey_the_rules() -> None:
    """Nights CP-SAT finds under random partial constraints satisfy the independent rule checker."""
    for seed in range(20):
        rng = random.Random(seed)
        setting = draw_setting(rng, draw_size(rng, 4))
        model = GameModel(setting)
        truth = simulate_night(rng, setting)
        pool = candidate_clues(rng, setting, truth, extra=30)
        for _ in range(3):
            feasible, _, night = model.solve([c.encode(model) for c in rng.sample(pool, 8)])
            assert feasible and night is not None
            assert check_rules(setting, night) == [], seed


def test_nearby_nights_are_legal_small_variations() -> None:
    for seed in range(30):
        rng = random.Random(seed)
        setting = draw_setting(rng, draw_size(rng, 4))
        truth = simulate_night(rng, setting)
        near = nearby_nights(setting, truth)
        assert near
        # The one-position changes are exactly those the independent rule checker accepts.
        expected = set()
        for e in range(setting.num_entities):
            for t in range(setting.num_times):
                for room in range(setting.num_rooms):
                    if room != truth.positions[e][t]:
                        positions = [list(p) for p in truth.positions]
                        positions[e][t] = room
                        if not check_rules(setting, replace(truth, positions=positions)):
                            expected.add((e, t, room))
        got = set()
        for moved, night in near:
            assert check_rules(setting, night) == [], seed
            diffs = [(e, t, night.positions[e][t]) for e in range(setting.num_entities)
                     for t in range(setting.num_times) if night.positions[e][t] != truth.positions[e][t]]
            swaps = sum(a != b for a, b in zip(night.motives, truth.motives))
            if moved == -1:
                assert not diffs and swaps == 2
            elif moved < -1:  # a suspect carrying a weapon to another room at one time
                suspect, weapon = divmod(-2 - moved, setting.num_entities)
                assert setting.is_suspect(suspect) and setting.is_weapon(weapon) and swaps == 0
                assert {e for e, _, _ in diffs} == {suspect, weapon} and len({(t, r) for _, t, r in diffs}) == 1
            else:
                assert swaps == 0 and {e for e, _, _ in diffs} == {moved} and len(diffs) in (1, 2)
                if len(diffs) == 2:  # two consecutive times of one entity
                    assert diffs[1][1] == diffs[0][1] + 1
                else:
                    got.add(diffs[0])
        assert got == expected, seed


# --- brute force: every possible night of a single-time puzzle --------------------------------


def all_nights(setting: Setting) -> list[Night]:
    """Every night with one time step that obeys the rules, enumerated from the rule text."""
    S, R = setting.num_suspects, setting.num_rooms
    if setting.motives:
        base = [m for m in range(len(setting.motives)) for _ in range(setting.motive_count(m))]
        motive_options = sorted(set(permutations(base)))
    else:
        motive_options = [()]
    out = []
    for pos in product(range(R), repeat=setting.num_entities):
        body = pos[setting.boddy]
        present = [s for s in range(S) if pos[s] == body]
        if len(present) != 1:
            continue
        for w in range(len(setting.weapons)):
            if pos[setting.weapon_entity(w)] == body:
                for motives in motive_options:
                    out.append(Night([[p] for p in pos], list(motives), present[0], w, body, 0))
    return out


def _same(a: Night, b: Night) -> bool:
    return (a.positions, a.motives, a.murderer, a.weapon, a.room, a.time) == (
        b.positions, b.motives, b.murderer, b.weapon, b.room, b.time)


def test_brute_force_confirms_unique_and_irredundant_clue_sets() -> None:
    checked = 0
    for seed in range(400):
        puzzle = build_puzzle(seed, 1)
        s = puzzle.setting
        if s.num_times != 1 or s.num_rooms ** s.num_entities > 5000:
            continue
        nights = all_nights(s)
        assert all(check_rules(s, n) == [] for n in nights)
        clues = puzzle.clues
        broken = [[c for c in clues if not c.holds(s, n)] for n in nights]
        solutions = [n for n, b in zip(nights, broken) if not b]
        assert len(solutions) == 1 and _same(solutions[0], puzzle.night), seed
        for clue in clues:
            # Dropping this clue must let in another night: one that breaks this clue only.
            assert any(b == [clue] for b in broken), (seed, clue.text(s))
        checked += 1
        if checked == 12:
            break
    assert checked == 12
