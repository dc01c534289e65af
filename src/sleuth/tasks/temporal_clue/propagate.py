"""Propagation alone: how many rounds of plain elimination each question of a one-time puzzle needs.

The ladder's rungs (`ladder.py`) promise puzzles a reader solves without guessing: each answer is a
clue looked up (depth 0) or follows after one or two rounds of elimination. This module checks that
independently of CP-SAT's search: domains of candidate values (each entity's room, the murderer,
weapon and room, each suspect's motive) are narrowed by the clues (round 0) and then by the rules,
all rules applied at once per round, until nothing changes. A question's depth is the round after
which its answer is the only candidate left; None when propagation never pins it down.

It covers the rung language only: a single time step, and clues that are plain facts or negations
about named things (`At`, `Murder`, `Motive`, and "not" of `At`). `depths` returns None for any
other clue or for a setting with several times. The rules are the game's (game.py) at one time:

- Mr. Boddy is in the murder room; the murder weapon is there; the murderer is there;
- no other suspect is there (so a suspect known to be there is the murderer);
- with one motive per suspect, motives are all different.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sleuth.tasks.temporal_clue.clues import At, Clue, Motive, Murder
from sleuth.tasks.temporal_clue.game import Setting
from sleuth.tasks.temporal_clue.prompt import Question


@dataclass
class Domains:
    pos: list[set[int]]
    murder: dict[str, set[int]]
    motive: list[set[int]] = field(default_factory=list)

    def copy(self) -> Domains:
        return Domains([set(p) for p in self.pos], {k: set(v) for k, v in self.murder.items()},
                       [set(m) for m in self.motive])

    def key(self) -> tuple[object, ...]:
        return (tuple(map(frozenset, self.pos)), tuple((k, frozenset(v)) for k, v in sorted(self.murder.items())),
                tuple(map(frozenset, self.motive)))


def _named(atom: object) -> bool:
    return all(r.kind == "name" for r in atom.refs())  # type: ignore[attr-defined]


def read_clues(setting: Setting, clues: Sequence[Clue]) -> Domains | None:
    """Round 0: every candidate, narrowed by what each clue states (None: a clue outside the language)."""
    s = setting
    d = Domains([set(range(s.num_rooms)) for _ in range(s.num_entities)],
                {"murderer": set(range(s.num_suspects)), "weapon": set(range(len(s.weapons))),
                 "room": set(range(s.num_rooms))},
                [set(range(len(s.motives))) for _ in range(s.num_suspects)] if s.motives else [])
    for clue in clues:
        atom = clue.atoms[0]
        if len(clue.atoms) != 1 or clue.form not in ("fact", "not") or not _named(atom):
            return None
        if isinstance(atom, At):
            rooms = {atom.room} if clue.form == "fact" else set(range(s.num_rooms)) - {atom.room}
            d.pos[atom.who.value] &= rooms
        elif isinstance(atom, Murder) and clue.form == "fact" and atom.field in d.murder:
            d.murder[atom.field] &= {atom.value}
        elif isinstance(atom, Motive) and clue.form == "fact" and d.motive:
            d.motive[atom.who.value] &= {atom.motive}
        else:
            return None
    return d


def step(setting: Setting, old: Domains) -> Domains:
    """One round: every rule applied to `old` (all at once), the results intersected."""
    s, d = setting, old.copy()
    room = old.murder["room"]
    body = s.boddy
    d.murder["room"] &= old.pos[body]
    d.pos[body] &= room
    d.murder["weapon"] = {w for w in old.murder["weapon"] if old.pos[s.weapon_entity(w)] & room}
    d.murder["murderer"] = {m for m in old.murder["murderer"] if old.pos[m] & room}
    if len(old.murder["weapon"]) == 1:
        e = s.weapon_entity(next(iter(old.murder["weapon"])))
        d.murder["room"] &= old.pos[e]
        d.pos[e] &= room
    murderers = old.murder["murderer"]
    if len(murderers) == 1:
        m = next(iter(murderers))
        d.murder["room"] &= old.pos[m]
        d.pos[m] &= room
        for other in range(s.num_suspects):
            if other != m and len(old.pos[other]) == 1:
                d.murder["room"] -= old.pos[other]  # another suspect's room is not the murder room
            if other != m and len(room) == 1:
                d.pos[other] -= room  # the murderer was alone with Mr. Boddy
    if len(room) == 1:
        there = [x for x in range(s.num_suspects) if old.pos[x] == room]
        for x in there:
            d.murder["murderer"] &= {x}  # a suspect in the murder room is the murderer
    if s.unique_motives and old.motive:
        for x, motives in enumerate(old.motive):
            if len(motives) == 1:
                for other in range(s.num_suspects):
                    if other != x:
                        d.motive[other] -= motives
        for k in range(len(s.motives)):
            holders = [x for x in range(s.num_suspects) if k in old.motive[x]]
            if len(holders) == 1:
                d.motive[holders[0]] &= {k}
    return d


def answered(setting: Setting, d: Domains, question: Question) -> bool:
    """Whether the domains leave one answer to `question` (its atom names the true one)."""
    atom = question.atom
    if isinstance(atom, Murder):
        return len(d.murder.get(atom.field, ())) == 1
    if isinstance(atom, At) and atom.who.kind == "name":
        return len(d.pos[atom.who.value]) == 1
    if isinstance(atom, Motive) and d.motive:
        if atom.who.kind == "murderer":
            return len(set().union(*(d.motive[m] for m in d.murder["murderer"]))) == 1
        if question.placeholder == "SUSPECT":  # "Who is motivated by M?"
            return sum(atom.motive in m for m in d.motive) == 1
        return len(d.motive[atom.who.value]) == 1
    return False


def depths(setting: Setting, clues: Sequence[Clue], questions: Sequence[Question],
           max_rounds: int = 50) -> list[int | None] | None:
    """Each question's depth (rounds of elimination after reading the clues; None: never pinned down
    by propagation), or None when the puzzle is outside the language (several times, other clues).
    An empty domain (clues that contradict the rules) raises ValueError."""
    if setting.num_times != 1:
        return None
    d = read_clues(setting, clues)
    if d is None:
        return None
    out: list[int | None] = [None] * len(questions)
    for rounds in range(max_rounds + 1):
        if any(not p for p in d.pos) or any(not v for v in d.murder.values()) or any(not m for m in d.motive):
            raise ValueError("the clues contradict the rules")
        for i, q in enumerate(questions):
            if out[i] is None and answered(setting, d, q):
                out[i] = rounds
        nxt = step(setting, d)
        if nxt.key() == d.key():
            break
        d = nxt
    return out
