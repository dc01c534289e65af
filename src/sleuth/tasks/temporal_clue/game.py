"""Temporal Clue: the mansion, the cast, the rules of a night, and a simulated night that obeys them.

Entities are numbered suspects first, then weapons, then Mr. Boddy (see `Setting.boddy`).
A `Night` is the hidden truth a puzzle asks about: every entity's room at every time step,
each suspect's motive, and the murder (murderer, weapon, room, time).

Rules (the same ones the prompt states and the CP-SAT model in `solver.py` enforces):
- at each step every person (suspect or Mr. Boddy) stays or moves to an orthogonally adjacent room;
- a weapon stays, or moves along with a suspect who makes exactly the same move at that step;
- the murderer and Mr. Boddy were alone (no other suspect) in the murder room at the murder time,
  with the murder weapon there too;
- after the murder Mr. Boddy's body stays in the murder room.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from functools import cached_property

SUSPECT_NAMES = (
    "Miss Scarlet", "Colonel Mustard", "Mrs. White", "Mr. Green", "Mrs. Peacock",
    "Professor Plum", "Madame Rose", "Sgt. Gray", "Monsieur Brunette", "Miss Peach",
)
WEAPON_NAMES = ("Candlestick", "Knife", "Lead Pipe", "Revolver", "Rope", "Wrench", "Poison", "Horseshoe")
ROOM_NAMES = (
    "Kitchen", "Ballroom", "Conservatory", "Dining Room", "Billiard Room", "Library", "Lounge",
    "Hall", "Study", "Studio", "Gazebo", "Drawing Room", "Trophy Room", "Cloak Room", "Courtyard",
    "Fountain", "Carriage House",
)
MOTIVE_NAMES = ("Jealousy", "Ambition", "Power", "Betrayal", "Anger", "Fear", "Greed", "Hatred", "Revenge", "Pride")
# Rooms read "at the Fountain" rather than "in the Fountain".
AT_ROOMS = frozenset({"Fountain"})
DIRECTIONS = ("north", "south", "east", "west")
_DELTA = {"north": (-1, 0), "south": (1, 0), "east": (0, 1), "west": (0, -1)}


@dataclass(frozen=True)
class Layout:
    """Rooms on a grid, filled row by row; cells past the last room are empty."""

    rooms: tuple[str, ...]
    cols: int

    @cached_property
    def rows(self) -> int:
        return math.ceil(len(self.rooms) / self.cols)

    def cell(self, room: int) -> tuple[int, int]:
        return divmod(room, self.cols)

    def room_at(self, row: int, col: int) -> int | None:
        if not (0 <= row < self.rows and 0 <= col < self.cols):
            return None
        index = row * self.cols + col
        return index if index < len(self.rooms) else None

    def step(self, room: int, direction: str) -> int | None:
        """The room one step from `room` in `direction` (None off the map)."""
        row, col = self.cell(room)
        dr, dc = _DELTA[direction]
        return self.room_at(row + dr, col + dc)

    def neighbors(self, room: int) -> list[int]:
        return self._adjacency[room][1:]

    def reachable(self, room: int) -> list[int]:
        """Rooms a person in `room` can be in one step later (stay or move)."""
        return self._adjacency[room]

    @cached_property
    def _adjacency(self) -> list[list[int]]:
        # Looked up in the inner loops of the solver and the rule checks, so computed once.
        return [[room, *(r for d in DIRECTIONS if (r := self.step(room, d)) is not None)]
                for room in range(len(self.rooms))]

    def edges(self) -> list[tuple[int, int]]:
        """Directed moves between adjacent rooms."""
        return [(a, b) for a in range(len(self.rooms)) for b in self.neighbors(a)]


def make_layout(rooms: tuple[str, ...]) -> Layout:
    return Layout(rooms=rooms, cols=max(1, math.ceil(math.sqrt(len(rooms)))))


@dataclass(frozen=True)
class Setting:
    """What a puzzle publicly states: the cast, the map, the candidate times and motives."""

    suspects: tuple[str, ...]
    weapons: tuple[str, ...]
    layout: Layout
    times: tuple[str, ...]
    motives: tuple[str, ...] = ()
    # Suspects per motive when motives are not one per suspect; None means each suspect has a
    # different motive (then len(motives) == len(suspects)).
    motive_counts: tuple[int, ...] | None = None

    @property
    def num_suspects(self) -> int:
        return len(self.suspects)

    @property
    def num_entities(self) -> int:
        return len(self.suspects) + len(self.weapons) + 1

    @property
    def boddy(self) -> int:
        return len(self.suspects) + len(self.weapons)

    @property
    def num_rooms(self) -> int:
        return len(self.layout.rooms)

    @property
    def num_times(self) -> int:
        return len(self.times)

    @property
    def unique_motives(self) -> bool:
        return bool(self.motives) and self.motive_counts is None

    def is_suspect(self, entity: int) -> bool:
        return entity < len(self.suspects)

    def is_weapon(self, entity: int) -> bool:
        return len(self.suspects) <= entity < self.boddy

    def weapon_entity(self, weapon: int) -> int:
        return len(self.suspects) + weapon

    def entity_name(self, entity: int) -> str:
        if entity < len(self.suspects):
            return self.suspects[entity]
        if entity < self.boddy:
            return "the " + self.weapons[entity - len(self.suspects)]
        return "Mr. Boddy"

    def motive_count(self, motive: int) -> int:
        return 1 if self.motive_counts is None else self.motive_counts[motive]


@dataclass
class Night:
    """The hidden truth: positions[entity][time] is a room index; motives[suspect] a motive index."""

    positions: list[list[int]]
    motives: list[int]
    murderer: int
    weapon: int  # weapon index (not entity index)
    room: int
    time: int
    # Which suspect carried which weapon at each step, as simulated (not part of the puzzle).
    carries: list[tuple[int, int, int]] = field(default_factory=list)

    def room_of(self, entity: int, time: int) -> int:
        return self.positions[entity][time]


def check_rules(setting: Setting, night: Night) -> list[str]:
    """Every way `night` breaks the rules, as readable lines (empty when it obeys them).

    Written directly from the rule text, independently of the CP-SAT model, so tests can use it
    to check both the simulation and the solver's witnesses.
    """
    problems: list[str] = []
    layout, T, S = setting.layout, setting.num_times, setting.num_suspects
    pos = night.positions
    if len(pos) != setting.num_entities or any(len(p) != T for p in pos):
        return ["positions have the wrong shape"]
    for e, path in enumerate(pos):
        for t in range(T):
            if not 0 <= path[t] < setting.num_rooms:
                problems.append(f"{setting.entity_name(e)} is in no room at step {t}")
    if problems:
        return problems
    for e in [*range(S), setting.boddy]:
        for t in range(1, T):
            if pos[e][t] not in layout.reachable(pos[e][t - 1]):
                problems.append(f"{setting.entity_name(e)} jumps at step {t}")
    for w in range(len(setting.weapons)):
        e = setting.weapon_entity(w)
        for t in range(1, T):
            a, b = pos[e][t - 1], pos[e][t]
            if a != b and not any(pos[s][t - 1] == a and pos[s][t] == b for s in range(S)):
                problems.append(f"{setting.entity_name(e)} moves alone at step {t}")
    r, t = night.room, night.time
    if pos[setting.boddy][t] != r:
        problems.append("Mr. Boddy is not in the murder room at the murder time")
    if pos[setting.weapon_entity(night.weapon)][t] != r:
        problems.append("the murder weapon is not in the murder room at the murder time")
    present = [s for s in range(S) if pos[s][t] == r]
    if present != [night.murderer]:
        problems.append("the murderer is not alone with Mr. Boddy at the murder")
    if any(pos[setting.boddy][u] != r for u in range(t, T)):
        problems.append("Mr. Boddy's body moves after the murder")
    if setting.motives:
        if len(night.motives) != S or any(not 0 <= m < len(setting.motives) for m in night.motives):
            problems.append("motives have the wrong shape")
        else:
            for m in range(len(setting.motives)):
                if night.motives.count(m) != setting.motive_count(m):
                    problems.append(f"motive {setting.motives[m]} has the wrong count")
    return problems


def format_time(minutes: int) -> str:
    """Minutes after midnight of the evening's day (may exceed 24h) -> "11:45 PM"."""
    minutes %= 24 * 60
    hour, minute = divmod(minutes, 60)
    suffix = "AM" if hour < 12 else "PM"
    hour12 = hour % 12 or 12
    return f"{hour12:02d}:{minute:02d} {suffix}"


def draw_times(rng: random.Random, count: int) -> tuple[str, ...]:
    """`count` consecutive times in 15, 30 or 60 minute steps between 8 PM and 3 AM."""
    earliest, latest = 20 * 60, 27 * 60
    steps = [s for s in (15, 30, 60) if (count - 1) * s <= latest - earliest]
    step = rng.choice(steps)
    span = (count - 1) * step
    # Prefer nights that reach midnight, like the published set.
    first = max(earliest, 24 * 60 - span)
    starts = list(range(first - first % step, latest - span + 1, step)) or [earliest]
    start = rng.choice(starts[: max(1, len(starts) // 2)])
    return tuple(format_time(start + i * step) for i in range(count))


@dataclass(frozen=True)
class Size:
    suspects: int
    weapons: int
    rooms: int
    times: int
    motives: bool


def draw_size(rng: random.Random, difficulty: int) -> Size:
    """Players drawn from 1..difficulty drive every count (difficulty 6 spans the published set)."""
    players = rng.randint(1, difficulty)
    suspects = min(10, 2 + round(1.6 * (players - 1)) + rng.randint(0, 1))
    weapons = min(8, max(2, suspects - rng.randint(0, 2)))
    rooms = min(15, suspects + rng.randint(0, players))  # the published maximum
    times = rng.randint(1, min(11, 2 * players))
    motives = rng.random() < 0.75
    return Size(suspects, weapons, rooms, times, motives)


def draw_setting(rng: random.Random, size: Size) -> Setting:
    suspects = tuple(rng.sample(SUSPECT_NAMES, size.suspects))
    weapons = tuple(rng.sample(WEAPON_NAMES, size.weapons))
    rooms = tuple(rng.sample(ROOM_NAMES, size.rooms))
    times = draw_times(rng, size.times)
    motives: tuple[str, ...] = ()
    counts: tuple[int, ...] | None = None
    if size.motives:
        if size.suspects >= 4 and rng.random() < 0.25:
            # Fewer motives than suspects, stated with counts ("Power (3 suspects)").
            k = rng.randint(2, size.suspects - 1)
            motives = tuple(rng.sample(MOTIVE_NAMES, k))
            cuts = sorted(rng.sample(range(1, size.suspects), k - 1))
            bounds = [0, *cuts, size.suspects]
            counts = tuple(bounds[i + 1] - bounds[i] for i in range(k))
        else:
            motives = tuple(rng.sample(MOTIVE_NAMES, size.suspects))
    return Setting(suspects, weapons, make_layout(rooms), times, motives, counts)


def _simulate_paths(rng: random.Random, setting: Setting) -> tuple[list[list[int]], list[tuple[int, int, int]]]:
    layout, S, T = setting.layout, setting.num_suspects, setting.num_times
    R = setting.num_rooms
    pos = [[rng.randrange(R)] for _ in range(setting.num_entities)]
    carries: list[tuple[int, int, int]] = []
    for t in range(1, T):
        for e in [*range(S), setting.boddy]:
            here = pos[e][t - 1]
            pos[e].append(rng.choice(layout.neighbors(here)) if rng.random() < 0.6 and layout.neighbors(here) else here)
        # Each moving suspect may carry one weapon from the room they leave.
        carried: set[int] = set()
        for s in rng.sample(range(S), S):
            a, b = pos[s][t - 1], pos[s][t]
            if a == b or rng.random() < 0.5:
                continue
            here = [w for w in range(len(setting.weapons)) if w not in carried
                    and pos[setting.weapon_entity(w)][t - 1] == a]
            if here:
                w = rng.choice(here)
                carried.add(w)
                carries.append((t, s, w))
        for w in range(len(setting.weapons)):
            e = setting.weapon_entity(w)
            mover = [s for (tt, s, ww) in carries if tt == t and ww == w]
            pos[e].append(pos[mover[0]][t] if mover else pos[e][t - 1])
    return pos, carries


def simulate_night(rng: random.Random, setting: Setting, max_tries: int = 500) -> Night:
    """A random night obeying the rules, with a murder at one of its opportunities."""
    S, T = setting.num_suspects, setting.num_times
    for _ in range(max_tries):
        pos, carries = _simulate_paths(rng, setting)
        options = []
        for t in range(T):
            r = pos[setting.boddy][t]
            present = [s for s in range(S) if pos[s][t] == r]
            if len(present) != 1:
                continue
            for w in range(len(setting.weapons)):
                if pos[setting.weapon_entity(w)][t] == r:
                    options.append((t, r, present[0], w))
        if not options:
            continue
        t, r, s, w = rng.choice(options)
        for u in range(t, T):
            pos[setting.boddy][u] = r
        motives: list[int] = []
        if setting.motives:
            if setting.motive_counts is None:
                motives = rng.sample(range(S), S)
            else:
                motives = [m for m, c in enumerate(setting.motive_counts) for _ in range(c)]
                rng.shuffle(motives)
        return Night(positions=pos, motives=motives, murderer=s, weapon=w, room=r, time=t, carries=carries)
    raise RuntimeError("could not simulate a night with a murder opportunity")
