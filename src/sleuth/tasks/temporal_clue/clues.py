"""Clues: statements about a night that render to text, evaluate on a `Night`, and encode in CP-SAT.

A `Clue` is a form (fact, not, or = at least one, either = exactly one, iff, if_then) over atoms
such as `At` ("X was in the R at T") or `Beside` ("X was in the room just north of Y at T"). Atoms name
people and weapons through a `Ref`: a name, "the murderer", "the murder weapon", or
"the suspect motivated by M". Each atom has three faces kept side by side so they cannot drift:
`text` (prompt wording), `holds` (plain Python on a Night; the independent checker used by tests)
and `encode` (a CP-SAT literal equivalent to the atom, built through `solver.GameModel`).
Drawing random candidate clues from a simulated night lives in `generate.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from sleuth.tasks.temporal_clue.game import AT_ROOMS, Night, Setting

if TYPE_CHECKING:
    from sleuth.tasks.temporal_clue.solver import GameModel, Lit


def room_phrase(setting: Setting, room: int) -> str:
    name = setting.layout.rooms[room]
    return f"at the {name}" if name in AT_ROOMS else f"in the {name}"


def time_phrase(setting: Setting, time: int) -> str:
    """" at 11:45 PM", or nothing when the night has a single time."""
    return "" if setting.num_times == 1 else f" at {setting.times[time]}"


def capitalize(text: str) -> str:
    return text[:1].upper() + text[1:]


@dataclass(frozen=True)
class Ref:
    """How a clue names someone: kind is name, murderer, weapon (the murder weapon) or motive."""

    kind: str
    value: int = -1  # entity index for names, motive index for motives

    def resolve(self, setting: Setting, night: Night) -> int:
        if self.kind == "name":
            return self.value
        if self.kind == "murderer":
            return night.murderer
        if self.kind == "weapon":
            return setting.weapon_entity(night.weapon)
        return night.motives.index(self.value)

    def text(self, setting: Setting) -> str:
        if self.kind == "name":
            return setting.entity_name(self.value)
        if self.kind == "murderer":
            return "the murderer"
        if self.kind == "weapon":
            return "the murder weapon"
        return f"the suspect motivated by {setting.motives[self.value]}"

    def at(self, model: GameModel, room: int, time: int) -> Lit:
        return model.at(self.kind, self.value, room, time)


class Atom(Protocol):
    kind: str

    def text(self, setting: Setting) -> str: ...
    def holds(self, setting: Setting, night: Night) -> bool: ...
    def encode(self, model: GameModel) -> Lit: ...
    def refs(self) -> tuple[Ref, ...]: ...


@dataclass(frozen=True)
class At:
    who: Ref
    room: int
    time: int
    kind: str = "at"

    def text(self, setting: Setting) -> str:
        return f"{self.who.text(setting)} was {room_phrase(setting, self.room)}{time_phrase(setting, self.time)}"

    def holds(self, setting: Setting, night: Night) -> bool:
        return night.room_of(self.who.resolve(setting, night), self.time) == self.room

    def encode(self, model: GameModel) -> Lit:
        return self.who.at(model, self.room, self.time)

    def refs(self) -> tuple[Ref, ...]:
        return (self.who,)


@dataclass(frozen=True)
class Same:
    a: Ref
    b: Ref
    time: int
    kind: str = "same_room"

    def text(self, setting: Setting) -> str:
        return f"{self.a.text(setting)} was in the same room as {self.b.text(setting)}{time_phrase(setting, self.time)}"

    def holds(self, setting: Setting, night: Night) -> bool:
        return night.room_of(self.a.resolve(setting, night), self.time) == night.room_of(
            self.b.resolve(setting, night), self.time)

    def encode(self, model: GameModel) -> Lit:
        return model.or_([model.and_([self.a.at(model, r, self.time), self.b.at(model, r, self.time)])
                          for r in range(model.setting.num_rooms)])

    def refs(self) -> tuple[Ref, ...]:
        return (self.a, self.b)


@dataclass(frozen=True)
class Beside:
    """a was in the room one step `direction` of b's room."""

    a: Ref
    b: Ref
    direction: str
    time: int
    kind: str = "beside"

    def text(self, setting: Setting) -> str:
        return (f"{self.a.text(setting)} was in the room just {self.direction} of {self.b.text(setting)}"
                f"{time_phrase(setting, self.time)}")

    def holds(self, setting: Setting, night: Night) -> bool:
        rb = night.room_of(self.b.resolve(setting, night), self.time)
        return setting.layout.step(rb, self.direction) == night.room_of(self.a.resolve(setting, night), self.time)

    def encode(self, model: GameModel) -> Lit:
        layout, t = model.setting.layout, self.time
        pairs = [(ra, rb) for rb in range(model.setting.num_rooms) if (ra := layout.step(rb, self.direction)) is not None]
        return model.or_([model.and_([self.a.at(model, ra, t), self.b.at(model, rb, t)]) for ra, rb in pairs])

    def refs(self) -> tuple[Ref, ...]:
        return (self.a, self.b)


@dataclass(frozen=True)
class Together:
    a: Ref
    b: Ref
    room: int
    kind: str = "together"

    def text(self, setting: Setting) -> str:
        room = room_phrase(setting, self.room)
        if setting.num_times == 1:
            return f"{self.a.text(setting)} and {self.b.text(setting)} were {room} together"
        return f"{self.a.text(setting)} and {self.b.text(setting)} were {room} together at least once"

    def holds(self, setting: Setting, night: Night) -> bool:
        a, b = self.a.resolve(setting, night), self.b.resolve(setting, night)
        return any(night.room_of(a, t) == self.room == night.room_of(b, t) for t in range(setting.num_times))

    def encode(self, model: GameModel) -> Lit:
        return model.or_([model.and_([self.a.at(model, self.room, t), self.b.at(model, self.room, t)])
                          for t in range(model.setting.num_times)])

    def refs(self) -> tuple[Ref, ...]:
        return (self.a, self.b)


@dataclass(frozen=True)
class Moved:
    """who went from src (at time-1) to dst (at time); with `weapon`, the weapon made the same move."""

    who: Ref
    src: int
    dst: int
    time: int
    weapon: Ref | None = None
    kind: str = "moved"

    def text(self, setting: Setting) -> str:
        rooms = setting.layout.rooms
        what = f" {self.weapon.text(setting)}" if self.weapon else ""
        return (f"{self.who.text(setting)} moved{what} from the {rooms[self.src]} to the {rooms[self.dst]}"
                f"{time_phrase(setting, self.time)}")

    def holds(self, setting: Setting, night: Night) -> bool:
        movers = [self.who] + ([self.weapon] if self.weapon else [])
        return all(night.room_of(e := m.resolve(setting, night), self.time - 1) == self.src
                   and night.room_of(e, self.time) == self.dst for m in movers)

    def encode(self, model: GameModel) -> Lit:
        movers = [self.who] + ([self.weapon] if self.weapon else [])
        lits = [lit for m in movers for lit in (m.at(model, self.src, self.time - 1), m.at(model, self.dst, self.time))]
        return model.and_(lits)

    def refs(self) -> tuple[Ref, ...]:
        return (self.who, self.weapon) if self.weapon else (self.who,)


@dataclass(frozen=True)
class Motive:
    who: Ref
    motive: int
    kind: str = "motive"

    def text(self, setting: Setting) -> str:
        return f"{self.who.text(setting)} is motivated by {setting.motives[self.motive]}"

    def holds(self, setting: Setting, night: Night) -> bool:
        return night.motives[self.who.resolve(setting, night)] == self.motive

    def encode(self, model: GameModel) -> Lit:
        return model.motive(self.who.kind, self.who.value, self.motive)

    def refs(self) -> tuple[Ref, ...]:
        return (self.who,)


@dataclass(frozen=True)
class Murder:
    """One fact about the murder: field is murderer (suspect), weapon (index), room or time."""

    field: str
    value: int
    kind: str = "murder"

    def text(self, setting: Setting) -> str:
        if self.field == "murderer":
            return f"Mr. Boddy was killed by {setting.suspects[self.value]}"
        if self.field == "weapon":
            return f"Mr. Boddy was killed with the {setting.weapons[self.value]}"
        if self.field == "room":
            return f"Mr. Boddy was killed {room_phrase(setting, self.value)}"
        return f"Mr. Boddy was murdered at {setting.times[self.value]}"

    def holds(self, setting: Setting, night: Night) -> bool:
        return getattr(night, self.field) == self.value

    def encode(self, model: GameModel) -> Lit:
        return model.murder(self.field, self.value)

    def refs(self) -> tuple[Ref, ...]:
        return ()


@dataclass(frozen=True)
class Never:
    who: Ref
    room: int
    kind: str = "never"

    def text(self, setting: Setting) -> str:
        return f"{self.who.text(setting)} was never {room_phrase(setting, self.room)}"

    def holds(self, setting: Setting, night: Night) -> bool:
        e = self.who.resolve(setting, night)
        return all(night.room_of(e, t) != self.room for t in range(setting.num_times))

    def encode(self, model: GameModel) -> Lit:
        return ~model.or_([self.who.at(model, self.room, t) for t in range(model.setting.num_times)])

    def refs(self) -> tuple[Ref, ...]:
        return (self.who,)


@dataclass(frozen=True)
class Count:
    """How many suspects were in a room at a time."""

    room: int
    time: int
    count: int
    kind: str = "count"

    def text(self, setting: Setting) -> str:
        where = f"{room_phrase(setting, self.room)}{time_phrase(setting, self.time)}"
        if self.count == 0:
            return f"no suspect was {where}"
        if self.count == 1:
            return f"exactly one suspect was {where}"
        return f"exactly {self.count} suspects were {where}"

    def holds(self, setting: Setting, night: Night) -> bool:
        return sum(night.room_of(s, self.time) == self.room for s in range(setting.num_suspects)) == self.count

    def encode(self, model: GameModel) -> Lit:
        return model.count(self.room, self.time, self.count)

    def refs(self) -> tuple[Ref, ...]:
        return ()


# --- top-level clues -------------------------------------------------------------------------


@dataclass(frozen=True)
class Clue:
    """form: fact | not | or (at least one) | either (exactly one) | iff | if_then."""

    form: str
    atoms: tuple[Atom, ...]

    @property
    def kind(self) -> str:
        if self.form != "fact":
            return self.form if self.form != "not" else f"not_{self.atoms[0].kind}"
        atom = self.atoms[0]
        kinds = {r.kind for r in atom.refs()}
        base = atom.kind
        if isinstance(atom, Murder):
            base = f"murder_{atom.field}"
        if isinstance(atom, Moved) and atom.weapon is not None:
            base = "moved_weapon"
        if kinds & {"murderer", "weapon"}:
            return f"{base}_via_murderer"
        if "motive" in kinds:
            return f"{base}_via_motive"
        return base

    @property
    def tier(self) -> int:
        """Removal priority: tier 0 (plain facts about named things) is dropped first, tier 2 last."""
        if self.form in ("or", "either", "iff", "if_then"):
            return 2
        atom = self.atoms[0]
        direct = all(r.kind == "name" for r in atom.refs())
        if self.form == "fact" and direct and isinstance(atom, (At, Motive, Murder)):
            return 0
        if isinstance(atom, (Together, Never, Count)) or not direct:
            return 2
        return 1

    def text(self, setting: Setting) -> str:
        parts = [a.text(setting) for a in self.atoms]
        if self.form == "fact":
            return capitalize(parts[0])
        if self.form == "not":
            return capitalize(_negate(parts[0]))
        a, b = parts
        if self.form == "or":
            return f"{capitalize(a)} or {b}"
        if self.form == "either":
            return f"Either {a} or {b}, but not both"
        if self.form == "iff":
            return f"{capitalize(a)} if and only if {b}"
        return f"If {a}, then {b}"

    def holds(self, setting: Setting, night: Night) -> bool:
        values = [a.holds(setting, night) for a in self.atoms]
        return _combine(self.form, values)

    def encode(self, model: GameModel) -> Lit:
        lits = [a.encode(model) for a in self.atoms]
        if self.form == "fact":
            return lits[0]
        if self.form == "not":
            return ~lits[0]
        a, b = lits
        if self.form == "or":
            return model.or_([a, b])
        if self.form == "either":
            return model.or_([model.and_([a, ~b]), model.and_([~a, b])])
        if self.form == "iff":
            return model.or_([model.and_([a, b]), model.and_([~a, ~b])])
        return model.or_([~a, b])


def _combine(form: str, values: list[bool]) -> bool:
    if form == "fact":
        return values[0]
    if form == "not":
        return not values[0]
    a, b = values
    return {"or": a or b, "either": a != b, "iff": a == b, "if_then": (not a) or b}[form]


def _negate(text: str) -> str:
    for positive, negative in ((" was in the same room", " was not in the same room"), (" was in ", " was not in "),
                               (" was at ", " was not at ")):
        if positive in text:
            return text.replace(positive, negative, 1)
    raise ValueError(f"cannot negate clue text: {text}")
