"""The ladder below difficulty 1: small one-time puzzles a reader solves in 0, 1 or 2 rounds of elimination.

Rungs (sleuth.tasks.curriculum.RUNGS): `lookup` (level -2), every answer stated by a clue; `elim1`
(level -1), the deepest answer one round of elimination past the clues; `elim2` (level 0), two.
"Round" is `propagate.depths`'s: all the game's rules applied once to what is known so far.

A rung puzzle is built from the generator's own parts with smaller sizes: 2-4 suspects, 2-3
weapons, 2-4 rooms, one time, motives on about half; questions who / weapon / where (/ why) and
at most one bonus question; clues only plain facts and "not" about named things. The CP-SAT
selection (`solver.select_clues`) makes the answers unique and the clues irredundant (a witness
night per clue); then `propagate.depths` must pin every answer down by propagation alone with the
rung's exact depth, else the draw is rejected and the next one (same seeded stream) is tried.
"""

from __future__ import annotations

import random
from typing import Any

from sleuth.tasks.temporal_clue.clues import At, Clue, Motive, Murder, Ref
from sleuth.tasks.temporal_clue.game import Night, Setting, Size, draw_setting, simulate_night
from sleuth.tasks.temporal_clue.prompt import Question
from sleuth.tasks.temporal_clue.propagate import depths
from sleuth.tasks.temporal_clue.solver import Selection, select_clues

RUNG_DEPTH = {-2: 0, -1: 1, 0: 2}
"""Level -> the depth its deepest answer must have (every answer at most that)."""
RUNG_SIZES = {-2: ((2, 3), (2, 2), (2, 3)), -1: ((2, 3), (2, 3), (2, 4)), 0: ((3, 4), (2, 3), (3, 4))}
"""Level -> (suspects, weapons, rooms) ranges, drawn uniformly."""
MAX_ATTEMPTS = 400


def draw_rung_size(rng: random.Random, level: int) -> Size:
    (s0, s1), (w0, w1), (r0, r1) = RUNG_SIZES[level]
    return Size(rng.randint(s0, s1), rng.randint(w0, w1), rng.randint(r0, r1), 1, rng.random() < 0.5)


def rung_questions(rng: random.Random, setting: Setting, night: Night) -> list[Question]:
    """Who / weapon / where (/ why with motives) and, on half the puzzles, one bonus question."""
    s = setting
    rooms = s.layout.rooms
    qs = [Question("Who murdered Mr. Boddy?", s.suspects[night.murderer], "SUSPECT", s.suspects,
                   Murder("murderer", night.murderer)),
          Question("What weapon did the murderer use?", s.weapons[night.weapon], "WEAPON", s.weapons,
                   Murder("weapon", night.weapon)),
          Question("Where was the murder committed?", rooms[night.room], "ROOM", rooms, Murder("room", night.room))]
    if s.motives:
        k = night.motives[night.murderer]
        qs.append(Question("Why did the murderer do it?", s.motives[k], "MOTIVE", s.motives,
                           Motive(Ref("murderer"), k)))
    bonus: list[Question] = []
    for e in range(s.num_entities - 1):
        room = night.room_of(e, 0)
        bonus.append(Question(f"Where was {s.entity_name(e)}?", rooms[room], "ROOM", rooms,
                              At(Ref("name", e), room, 0), True))
    if s.motives:
        for i in range(s.num_suspects):
            k = night.motives[i]
            bonus.append(Question(f"What motivates {s.suspects[i]}?", s.motives[k], "MOTIVE", s.motives,
                                  Motive(Ref("name", i), k), True))
    return qs + ([rng.choice(bonus)] if rng.random() < 0.5 else [])


def _fact(atom: Any, setting: Setting, night: Night) -> Clue | None:
    """The plain, named fact a question's atom states (the murderer's motive: named)."""
    if isinstance(atom, Motive) and atom.who.kind == "murderer":
        return Clue("fact", (Motive(Ref("name", night.murderer), atom.motive),))
    return Clue("fact", (atom,))


def rung_pool(rng: random.Random, setting: Setting, night: Night, questions: list[Question],
              level: int) -> list[Clue]:
    """Candidate clues: at `lookup` each question's own fact; at `elim1` the same less one of them,
    plus every entity's room and every motive as plain facts; at `elim2` less two, plus where
    each entity was not."""
    own = [c for q in questions if (c := _fact(q.atom, setting, night)) is not None]
    if level == -2:
        return own
    hidden = set(rng.sample(range(len(own)), min(len(own) - 1, 1 if level == -1 else 2)))
    pool = [c for i, c in enumerate(own) if i not in hidden]
    s = setting
    for e in range(s.num_entities):
        room = night.room_of(e, 0)
        pool.append(Clue("fact", (At(Ref("name", e), room, 0),)))
        if level == 0:
            pool += [Clue("not", (At(Ref("name", e), r, 0),)) for r in range(s.num_rooms) if r != room]
    pool += [Clue("fact", (Motive(Ref("name", i), k),)) for i, k in enumerate(night.motives)]
    hidden_clues = {own[i] for i in hidden}
    return [c for c in dict.fromkeys(pool) if c not in hidden_clues]


def build_rung(seed: int, level: int) -> tuple[Setting, Night, list[Question], Selection, list[Clue]]:
    """(setting, night, questions, selection, clues in prompt order) of the rung puzzle `seed`."""
    target = RUNG_DEPTH[level]
    rng = random.Random(f"temporal-clue-rung:{seed}:{level}")
    for _ in range(MAX_ATTEMPTS):
        setting = draw_setting(rng, draw_rung_size(rng, level))
        night = simulate_night(rng, setting)
        questions = rung_questions(rng, setting, night)
        pool = rung_pool(rng, setting, night, questions, level)
        try:
            selection = select_clues(setting, night, [q.atom for q in questions], pool, rng)
        except RuntimeError:  # the pool leaves some answer open: draw again
            continue
        found = depths(setting, selection.clues, questions)
        if found is None or any(d is None for d in found) or max(d for d in found if d is not None) != target:
            continue
        clues = list(selection.clues)
        rng.shuffle(clues)
        return setting, night, questions, selection, clues
    raise RuntimeError(f"no rung-{level} puzzle found for seed {seed} in {MAX_ATTEMPTS} draws")
