"""Temporal Clue puzzles from a seed: size, night, questions, candidate clues, the CP-SAT
selection, the prompt; and JSONL files of them built on a process pool.

A record depends only on (seed, difficulty, list_choices). Puzzle i of a batch started at seed S
uses `puzzle_seed(S, i)`, so a file is identical whatever the worker count.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import sys
from collections import Counter
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from sleuth.errors import ConfigError, UserError
from sleuth.system import fsio
from sleuth.system.seeds import derive_seed
from sleuth.tasks.curriculum import LOWEST_LEVEL, level_name, parse_level
from sleuth.tasks.temporal_clue.clues import (
    At,
    Atom,
    Beside,
    Clue,
    Count,
    Motive,
    Moved,
    Murder,
    Never,
    Ref,
    Same,
    Together,
)
from sleuth.tasks.temporal_clue.game import (
    DIRECTIONS,
    Night,
    Setting,
    draw_setting,
    draw_size,
    simulate_night,
)
from sleuth.tasks.temporal_clue.prompt import Question, render_prompt
from sleuth.tasks.temporal_clue.solver import Selection, select_clues

MIN_DIFFICULTY, MAX_DIFFICULTY = LOWEST_LEVEL, 6
"""Levels 1..6 and, below them, the ladder's rungs -2..0 (lookup, elim1, elim2; `ladder.py`)."""
MAX_QUESTIONS = 8
# Drawn candidate clues per hidden position (on top of the plain facts): more gives the
# core more indirect clues to choose from, fewer keeps the first, largest model small.
POOL_FACTOR = 3.0


@dataclass
class Puzzle:
    seed: int
    difficulty: int
    setting: Setting
    night: Night
    questions: list[Question]
    clues: list[Clue]  # in prompt order
    selection: Selection  # the solver's result (clues in keep order, with witnesses)


# --- candidate clues ---------------------------------------------------------------------------


class Drafter:
    """Draws random atoms with a chosen truth value on the simulated night."""

    def __init__(self, rng: random.Random, setting: Setting, night: Night) -> None:
        self.rng, self.setting, self.night = rng, setting, night
        self.persons = [*range(setting.num_suspects), setting.boddy]
        self.things = list(range(setting.num_entities))

    def ref(self, entity: int) -> Ref:
        """A way to name `entity`: usually its name, sometimes by its role in the truth."""
        s, night, rng = self.setting, self.night, self.rng
        if entity == night.murderer and rng.random() < 0.25:
            return Ref("murderer")
        if s.is_weapon(entity) and entity == s.weapon_entity(night.weapon) and rng.random() < 0.25:
            return Ref("weapon")
        if s.is_suspect(entity) and s.unique_motives and rng.random() < 0.35:
            return Ref("motive", night.motives[entity])
        return Ref("name", entity)

    def time(self) -> int:
        return self.rng.randrange(self.setting.num_times)

    def at(self, want: bool) -> Atom | None:
        e, t = self.rng.choice(self.things), self.time()
        room = self.night.room_of(e, t)
        if not want:
            others = [r for r in range(self.setting.num_rooms) if r != room]
            room = self.rng.choice(others)
        return At(self.ref(e), room, t)

    def same(self, want: bool) -> Atom | None:
        t = self.time()
        a = self.rng.choice(self.things)
        ra = self.night.room_of(a, t)
        pool = [b for b in self.things if b != a and (self.night.room_of(b, t) == ra) == want]
        if not pool:
            return None
        return Same(self.ref(a), self.ref(self.rng.choice(pool)), t)

    def beside(self, want: bool) -> Atom | None:
        t, d = self.time(), self.rng.choice(DIRECTIONS)
        a = self.rng.choice(self.things)
        ra = self.night.room_of(a, t)
        pool = [b for b in self.things if b != a
                and (self.setting.layout.step(self.night.room_of(b, t), d) == ra) == want]
        if not pool:
            return None
        return Beside(self.ref(a), self.ref(self.rng.choice(pool)), d, t)

    def together(self, want: bool) -> Atom | None:
        a, b = self.rng.sample(self.things, 2)
        shared = {self.night.room_of(a, t) for t in range(self.setting.num_times)
                  if self.night.room_of(a, t) == self.night.room_of(b, t)}
        pool = sorted(shared) if want else [r for r in range(self.setting.num_rooms) if r not in shared]
        if not pool:
            return None
        return Together(self.ref(a), self.ref(b), self.rng.choice(pool))

    def moved(self, want: bool) -> Atom | None:
        if self.setting.num_times < 2:
            return None
        t = self.rng.randrange(1, self.setting.num_times)
        p = self.rng.choice(self.persons)
        src, dst = self.night.room_of(p, t - 1), self.night.room_of(p, t)
        if want and src == dst:
            return None
        if not want:
            src, dst = self.rng.choice(self.setting.layout.edges())
        return Moved(self.ref(p), src, dst, t)

    def moved_weapon(self, want: bool) -> Atom | None:
        if not want or not self.night.carries:
            return None
        t, s, w = self.rng.choice(self.night.carries)
        src, dst = self.night.room_of(s, t - 1), self.night.room_of(s, t)
        return Moved(self.ref(s), src, dst, t, weapon=self.ref(self.setting.weapon_entity(w)))

    def motive(self, want: bool) -> Atom | None:
        if not self.setting.motives:
            return None
        s = self.rng.randrange(self.setting.num_suspects)
        m = self.night.motives[s]
        if not want:
            m = self.rng.choice([k for k in range(len(self.setting.motives)) if k != m])
        who = Ref("murderer") if s == self.night.murderer and self.rng.random() < 0.4 else Ref("name", s)
        return Motive(who, m)

    def murder(self, want: bool) -> Atom | None:
        fields = ["weapon", "room"] + (["time"] if self.setting.num_times > 1 else [])
        f = self.rng.choice(fields)
        size = {"weapon": len(self.setting.weapons), "room": self.setting.num_rooms,
                "time": self.setting.num_times}[f]
        value = getattr(self.night, f)
        if not want:
            value = self.rng.choice([v for v in range(size) if v != value])
        return Murder(f, value)

    def never(self, want: bool) -> Atom | None:
        if self.setting.num_times < 2:
            return None
        e = self.rng.choice(self.things)
        seen = {self.night.room_of(e, t) for t in range(self.setting.num_times)}
        pool = [r for r in range(self.setting.num_rooms) if (r not in seen) == want]
        return Never(self.ref(e), self.rng.choice(pool)) if pool else None

    def count(self, want: bool) -> Atom | None:
        r, t = self.rng.randrange(self.setting.num_rooms), self.time()
        n = sum(self.night.room_of(s, t) == r for s in range(self.setting.num_suspects))
        if not want:
            n = self.rng.choice([k for k in range(3) if k != n])
        return Count(r, t, n)


# Relative frequency of each fact kind among drawn candidates, and which kinds may sit inside a
# compound clue (those whose false versions are natural sentences).
FACT_WEIGHTS = {"at": 1.5, "same": 3, "beside": 3, "together": 1.5, "moved": 2, "moved_weapon": 1.5,
                "motive": 1, "murder": 0.5, "never": 0.7, "count": 0.7}
COMPOUND_ATOMS = ("at", "at", "same", "moved", "motive", "beside")
FORM_WEIGHTS = {"fact": 5, "not": 0.7, "or": 1.2, "either": 0.8, "iff": 1.2, "if_then": 0.8}


def direct_facts(setting: Setting, night: Night) -> list[Clue]:
    """Plain facts that pin down the whole night; together they always make the answer unique."""
    facts = [Clue("fact", (At(Ref("name", e), night.room_of(e, t), t),))
             for e in range(setting.num_entities) for t in range(setting.num_times)]
    facts += [Clue("fact", (Motive(Ref("name", s), m),)) for s, m in enumerate(night.motives)]
    facts += [Clue("fact", (Murder("weapon", night.weapon),)), Clue("fact", (Murder("room", night.room),))]
    if setting.num_times > 1:
        facts.append(Clue("fact", (Murder("time", night.time),)))
    return facts


def _draw(drafter: Drafter, kind: str, want: bool) -> Atom | None:
    atom: Atom | None = getattr(drafter, kind)(want)
    # Some drafts (a random move, a "the murderer" reference) can land on the other truth value.
    if atom is None or atom.holds(drafter.setting, drafter.night) != want:
        return None
    return atom


def draw_clue(drafter: Drafter) -> Clue | None:
    """One random clue that is true of the simulated night (or None when the draw failed)."""
    rng = drafter.rng
    form = rng.choices(list(FORM_WEIGHTS), weights=list(FORM_WEIGHTS.values()))[0]
    if form == "fact":
        kind = rng.choices(list(FACT_WEIGHTS), weights=list(FACT_WEIGHTS.values()))[0]
        atom = _draw(drafter, kind, True)
        return Clue("fact", (atom,)) if atom else None
    if form == "not":
        atom = _draw(drafter, rng.choice(("at", "same")), False)
        return Clue("not", (atom,)) if atom else None
    # Truth values for the two parts that make the compound true, chosen at random.
    options = {"or": [(True, False), (False, True), (True, True)], "either": [(True, False), (False, True)],
               "iff": [(True, True), (False, False), (False, False)],
               "if_then": [(False, True), (False, False), (True, True)]}[form]
    wa, wb = rng.choice(options)
    a = _draw(drafter, rng.choice(COMPOUND_ATOMS), wa)
    b = _draw(drafter, rng.choice(COMPOUND_ATOMS), wb)
    if a is None or b is None or a == b:
        return None
    return Clue(form, (a, b))


def candidate_clues(rng: random.Random, setting: Setting, night: Night, extra: int) -> list[Clue]:
    """Direct facts plus up to `extra` distinct drawn clues, every one true of `night`."""
    drafter = Drafter(rng, setting, night)
    out = direct_facts(setting, night)
    seen: set[Clue] = set(out)
    drawn = 0
    for _ in range(20 * extra):
        if drawn >= extra:
            break
        clue = draw_clue(drafter)
        if clue is None or clue in seen or _self_referential(clue, setting, night):
            continue
        if not clue.holds(setting, night):
            raise AssertionError(f"drew a false clue: {clue}")
        seen.add(clue)
        out.append(clue)
        drawn += 1
    return out


def _self_referential(clue: Clue, setting: Setting, night: Night) -> bool:
    """Clues that relate a thing to itself ("the murderer was in the same room as Miss Scarlet" when
    she is the murderer) are trivially true or false; skip them."""
    for atom in clue.atoms:
        refs = atom.refs()
        if len(refs) == 2 and refs[0].resolve(setting, night) == refs[1].resolve(setting, night):
            return True
    return False


# --- puzzles ---------------------------------------------------------------------------------------


def puzzle_seed(batch_seed: int, index: int) -> int:
    """The seed of puzzle `index` in a batch: a 63-bit hash of both, independent of workers."""
    return derive_seed("temporal-clue", batch_seed, index, bits=64) >> 1


def check_difficulty(difficulty: int | str, what: str = "difficulty") -> int:
    """The level a difficulty names (1..6, or a rung: lookup, elim1, elim2 or -2..0); UserError otherwise."""
    try:
        return parse_level(difficulty, what)
    except ConfigError as e:
        raise UserError(str(e)) from None


def choose_questions(rng: random.Random, setting: Setting, night: Night) -> list[Question]:
    """Who / what / where / when / why (the dimensions present), then bonus questions up to 4-8 in all."""
    s = setting
    suspects, rooms, motives = s.suspects, s.layout.rooms, s.motives
    qs = [Question("Who murdered Mr. Boddy?", suspects[night.murderer], "SUSPECT", suspects,
                   Murder("murderer", night.murderer)),
          Question("What weapon did the murderer use?", s.weapons[night.weapon], "WEAPON", s.weapons,
                   Murder("weapon", night.weapon)),
          Question("Where was the murder committed?", rooms[night.room], "ROOM", rooms, Murder("room", night.room))]
    if s.num_times > 1:
        qs.append(Question("When did the murder occur?", s.times[night.time], "TIME", s.times,
                           Murder("time", night.time)))
    if motives:
        k = night.motives[night.murderer]
        qs.append(Question("Why did the murderer do it?", motives[k], "MOTIVE", motives, Motive(Ref("murderer"), k)))
    bonus: list[Question] = []
    for e in range(s.num_entities - 1):
        for t in range(s.num_times):
            who = s.entity_name(e)
            ref = Ref("name", e)
            if s.unique_motives and s.is_suspect(e) and rng.random() < 0.35:
                ref = Ref("motive", night.motives[e])
                who = ref.text(s)
            when = f" at {s.times[t]}" if s.num_times > 1 else ""
            room = night.room_of(e, t)
            bonus.append(Question(f"Where was {who}{when}?", rooms[room], "ROOM", rooms, At(ref, room, t), True))
    if motives:
        for i in range(s.num_suspects):
            k = night.motives[i]
            if s.unique_motives and rng.random() < 0.5:
                bonus.append(Question(f"Who is motivated by {motives[k]}?", suspects[i], "SUSPECT", suspects,
                                      Motive(Ref("name", i), k), True))
            else:
                bonus.append(Question(f"What motivates {suspects[i]}?", motives[k], "MOTIVE", motives,
                                      Motive(Ref("name", i), k), True))
    total = rng.randint(max(4, len(qs) + 1), MAX_QUESTIONS)
    return qs + rng.sample(bonus, min(len(bonus), total - len(qs)))


def whole_night(setting: Setting, night: Night) -> list[Atom]:
    """Every hidden fact: all positions at all times, all motives, the murder."""
    facts: list[Atom] = [At(Ref("name", e), night.room_of(e, t), t)
                         for e in range(setting.num_entities) for t in range(setting.num_times)]
    facts += [Motive(Ref("name", s), m) for s, m in enumerate(night.motives)]
    facts += [Murder("murderer", night.murderer), Murder("weapon", night.weapon), Murder("room", night.room),
              Murder("time", night.time)]
    return facts


def build_puzzle(seed: int, difficulty: int | str) -> Puzzle:
    """Everything about one puzzle, including the solver's proofs (tests look at those)."""
    difficulty = check_difficulty(difficulty)
    if difficulty < 1:
        from sleuth.tasks.temporal_clue.ladder import build_rung

        setting, night, questions, selection, clues = build_rung(seed, difficulty)
        return Puzzle(seed, difficulty, setting, night, questions, clues, selection)
    rng = random.Random(f"temporal-clue:{seed}:{difficulty}")
    setting = draw_setting(rng, draw_size(rng, difficulty))
    night = simulate_night(rng, setting)
    questions = choose_questions(rng, setting, night)
    facts = setting.num_entities * setting.num_times
    pool = candidate_clues(rng, setting, night, extra=min(400, 30 + int(POOL_FACTOR * facts)))
    # Unique over the whole night (every position, motive and the murder), like the published set:
    # every question is then answerable, and clue counts scale with entities x times as theirs do.
    selection = select_clues(setting, night, [q.atom for q in questions] + whole_night(setting, night), pool, rng)
    clues = list(selection.clues)
    rng.shuffle(clues)
    return Puzzle(seed, difficulty, setting, night, questions, clues, selection)


def shuffled_choices(puzzle: Puzzle) -> list[Question]:
    """The questions with each one's choices in its own order, shuffled by a stream seeded from the
    puzzle's seed and level alone (so no answer position beats chance in expectation, and the order
    is the same in every file and training prompt of this puzzle)."""
    rng = random.Random(f"temporal-clue-choices:{puzzle.seed}:{puzzle.difficulty}")
    return [replace(q, choices=tuple(rng.sample(q.choices, len(q.choices)))) for q in puzzle.questions]


def puzzle_record(puzzle: Puzzle, list_choices: bool = False) -> dict[str, Any]:
    """The JSONL record: the published fields plus our metadata. With the choices listed, each
    question lists them (and "choices" holds them) in a seeded shuffled order (shuffled_choices)."""
    questions = shuffled_choices(puzzle) if list_choices else puzzle.questions
    letters = [chr(ord("A") + i) for i in range(len(questions))]
    return {
        "num_clues": len(puzzle.clues),
        "prompt": render_prompt(puzzle.setting, puzzle.clues, questions, list_choices,
                                compact=puzzle.difficulty < 1),
        "solution": {a: q.answer for a, q in zip(letters, questions)},
        "seed": puzzle.seed,
        "difficulty": level_name(puzzle.difficulty) if puzzle.difficulty < 1 else puzzle.difficulty,
        "clue_kinds": dict(sorted(Counter(c.kind for c in puzzle.clues).items())),
        "choices": {a: list(q.choices) for a, q in zip(letters, questions)},
    }


def generate_puzzle(seed: int, difficulty: int | str, list_choices: bool = False) -> dict[str, Any]:
    """One puzzle record; the same (seed, difficulty, list_choices) always gives the same record."""
    return puzzle_record(build_puzzle(seed, difficulty), list_choices)


def _line(index: int, seed: int, difficulty: int | str, list_choices: bool) -> str:
    return json.dumps(generate_puzzle(puzzle_seed(seed, index), difficulty, list_choices), ensure_ascii=False)


def generate_file(n: int, seed: int, difficulty: int | str, workers: int | None, out: str | Path,
                  list_choices: bool = False, progress: bool = True) -> Path:
    """Write n puzzles as JSONL in index order, generated on `workers` processes (all cores if None)."""
    if n < 1:
        raise UserError(f"--n must be at least 1, got {n}")
    difficulty = check_difficulty(difficulty)
    workers = workers or os.cpu_count() or 1
    if workers < 1:
        raise UserError(f"--workers must be at least 1, got {workers}")
    path = Path(out)
    if path.parent and not path.parent.exists():
        raise UserError(f"output folder does not exist: {path.parent}")
    if path.is_dir():
        raise UserError(f"--out {path} is a folder; give a file name such as {path / 'puzzles.jsonl'}")
    fsio.check_writable(path.parent)  # before the work, not after it
    job = partial(_line, seed=seed, difficulty=difficulty, list_choices=list_choices)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("puzzles"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(file=sys.stderr), disable=not progress) as bar, \
            fsio.atomic_file(path) as f:  # an interrupted run leaves an existing file as it was
        task = bar.add_task("puzzles", total=n)
        if workers == 1:
            lines = map(job, range(n))
            for line in lines:
                f.write(line + "\n")
                bar.advance(task)
        else:
            # spawn-safe and ordered: imap yields results in index order whatever finishes first.
            with multiprocessing.get_context("spawn").Pool(min(workers, n)) as pool:
                for line in pool.imap(job, range(n), chunksize=1):
                    f.write(line + "\n")
                    bar.advance(task)
    return path
