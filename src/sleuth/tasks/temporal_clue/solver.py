"""The game and its clues in OR-Tools CP-SAT, and the choice of an irredundant, unique clue set.

Uniqueness is tested the cheap way: one solve asks for a night that obeys the rules and the clues
but differs from the truth in at least one answer (a single clause: the OR of the negated true
answers). INFEASIBLE means the answers are determined, and equal to the truth. No enumeration.
The model is built once per puzzle; clues are switched on as solver assumptions, so dropping a
clue is a new assumption list, not a new model. An infeasible solve also returns a core (a subset
of the assumed clues that already forces the answers), which lets one solve drop many clues.

Uniqueness scope (chosen by the caller, `generate.py`): the whole hidden night, i.e. every
entity's room at every time, every motive, and the murder, plus the question answers (implied).
So every question, including any bonus question, is answerable, and clue counts match the
published set (3-100; they scale with entities x times as the published ones do).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ortools.sat.python import cp_model

from sleuth.tasks.temporal_clue.clues import Atom, Clue
from sleuth.tasks.temporal_clue.game import Night, Setting

Lit = Any  # a CP-SAT Boolean variable or its negation
# Share of the plain facts an alternative night breaks that are added per round of phase 1.
ADD_FRACTION = 0.25


def _key(lit: Lit) -> int:
    return int(lit.index)


class GameModel:
    """CP-SAT variables for one setting: x[entity][time][room], the murder, the motives."""

    def __init__(self, setting: Setting) -> None:
        self.setting = setting
        m = self.model = cp_model.CpModel()
        S, W, R, T = setting.num_suspects, len(setting.weapons), setting.num_rooms, setting.num_times
        E, B, layout = setting.num_entities, setting.boddy, setting.layout
        self._and: dict[tuple[int, ...], Lit] = {}
        self._or: dict[tuple[int, ...], Lit] = {}
        self._cache: dict[tuple[Any, ...], Lit] = {}
        self._carriers: dict[tuple[int, int, int, int], Lit] = {}
        self.false = m.new_bool_var("false")
        m.add(self.false == 0)
        self.x = [[[m.new_bool_var(f"x{e}_{t}_{r}") for r in range(R)] for t in range(T)] for e in range(E)]
        for e in range(E):
            for t in range(T):
                m.add_exactly_one(self.x[e][t])
                if t:  # stay or take one orthogonal step (weapons too, when carried)
                    for r in range(R):
                        m.add_bool_or([~self.x[e][t][r], *(self.x[e][t - 1][q] for q in layout.reachable(r))])
        # A weapon's move a->b at t needs some suspect making the same move a->b at t.
        for w in range(W):
            xw = self.x[setting.weapon_entity(w)]
            for t in range(1, T):
                for a, b in layout.edges():
                    m.add_bool_or([~xw[t - 1][a], ~xw[t][b], *(self._carrier(s, t, a, b) for s in range(S))])
        self.murderer = [m.new_bool_var(f"murderer{s}") for s in range(S)]
        self.weapon = [m.new_bool_var(f"weapon{w}") for w in range(W)]
        self.room = [m.new_bool_var(f"room{r}") for r in range(R)]
        self.time = [m.new_bool_var(f"time{t}") for t in range(T)]
        for group in (self.murderer, self.weapon, self.room, self.time):
            m.add_exactly_one(group)
        when_where = [[m.new_bool_var(f"tr{t}_{r}") for r in range(R)] for t in range(T)]
        m.add_exactly_one([v for row in when_where for v in row])
        for t in range(T):
            m.add(sum(when_where[t]) == self.time[t])
        for r in range(R):
            m.add(sum(when_where[t][r] for t in range(T)) == self.room[r])
        for t in range(T):
            for r in range(R):
                tr = when_where[t][r]
                m.add_implication(tr, self.x[B][t][r])
                for w in range(W):
                    m.add_bool_or([~tr, ~self.weapon[w], self.x[setting.weapon_entity(w)][t][r]])
                # The murderer is there, and no other suspect is.
                m.add(sum(self.x[s][t][r] for s in range(S)) == 1).only_enforce_if(tr)
                for s in range(S):
                    m.add_bool_or([~tr, ~self.murderer[s], self.x[s][t][r]])
        # After the murder the body stays put.
        for t in range(1, T):
            dead = m.new_bool_var(f"dead{t}")
            m.add(sum(self.time[:t]) == dead)
            for r in range(R):
                m.add_bool_or([~dead, ~self.x[B][t - 1][r], self.x[B][t][r]])
        self.motive_vars: list[list[Lit]] = []
        if setting.motives:
            K = len(setting.motives)
            self.motive_vars = [[m.new_bool_var(f"motive{s}_{k}") for k in range(K)] for s in range(S)]
            for s in range(S):
                m.add_exactly_one(self.motive_vars[s])
            for k in range(K):
                m.add(sum(self.motive_vars[s][k] for s in range(S)) == setting.motive_count(k))

    def fork(self) -> GameModel:
        """An independent copy of the model as it stands (CP-SAT proto cloned, caches copied), so a
        second model over the same variables costs a proto copy instead of a Python rebuild."""
        other = object.__new__(GameModel)
        other.__dict__.update(self.__dict__)
        other.model = self.model.clone()
        other._and, other._or = dict(self._and), dict(self._or)
        other._cache, other._carriers = dict(self._cache), dict(self._carriers)
        return other

    # --- literal builders (cached, so equal sub-formulas share one variable) -------------------

    def and_(self, lits: Sequence[Lit]) -> Lit:
        if len(lits) == 1:
            return lits[0]
        key = tuple(sorted({_key(v) for v in lits}))
        if key not in self._and:
            v = self.model.new_bool_var("")
            self.model.add_bool_or([v, *(~a for a in lits)])
            self.model.add_bool_and(list(lits)).only_enforce_if(v)
            self._and[key] = v
        return self._and[key]

    def or_(self, lits: Sequence[Lit]) -> Lit:
        if not lits:
            return self.false
        if len(lits) == 1:
            return lits[0]
        key = tuple(sorted({_key(v) for v in lits}))
        if key not in self._or:
            v = self.model.new_bool_var("")
            self.model.add_bool_or(list(lits)).only_enforce_if(v)
            self.model.add_bool_and([~a for a in lits]).only_enforce_if(~v)
            self._or[key] = v
        return self._or[key]

    def _carrier(self, suspect: int, time: int, a: int, b: int) -> Lit:
        """True only if `suspect` moved a -> b at `time` (one-way: all the carry rule needs)."""
        key = (suspect, time, a, b)
        if key not in self._carriers:
            v = self.model.new_bool_var("")
            self.model.add_bool_and([self.x[suspect][time - 1][a], self.x[suspect][time][b]]).only_enforce_if(v)
            self._carriers[key] = v
        return self._carriers[key]

    def at(self, kind: str, value: int, room: int, time: int) -> Lit:
        """`kind`-referenced entity (name, murderer, weapon, motive) is in `room` at `time`."""
        s = self.setting
        if kind == "name":
            return self.x[value][time][room]
        key = ("at", kind, value, room, time)
        if key not in self._cache:
            if kind == "murderer":
                pairs = [(self.murderer[i], self.x[i][time][room]) for i in range(s.num_suspects)]
            elif kind == "weapon":
                pairs = [(self.weapon[w], self.x[s.weapon_entity(w)][time][room]) for w in range(len(s.weapons))]
            else:
                pairs = [(self.motive_vars[i][value], self.x[i][time][room]) for i in range(s.num_suspects)]
            self._cache[key] = self.or_([self.and_(list(p)) for p in pairs])
        return self._cache[key]

    def motive(self, kind: str, value: int, motive: int) -> Lit:
        if kind == "name":
            return self.motive_vars[value][motive]
        if kind != "murderer":
            raise ValueError(f"motive of a {kind} reference is not supported")
        return self.or_([self.and_([self.murderer[i], self.motive_vars[i][motive]])
                         for i in range(self.setting.num_suspects)])

    def murder(self, field: str, value: int) -> Lit:
        return {"murderer": self.murderer, "weapon": self.weapon, "room": self.room, "time": self.time}[field][value]

    def count(self, room: int, time: int, n: int) -> Lit:
        key = ("count", room, time, n)
        if key not in self._cache:
            v = self.model.new_bool_var("")
            total = sum(self.x[s][time][room] for s in range(self.setting.num_suspects))
            self.model.add(total == n).only_enforce_if(v)
            self.model.add(total != n).only_enforce_if(~v)
            self._cache[key] = v
        return self._cache[key]

    # --- solving ---------------------------------------------------------------------------------

    def require_differs(self, answers: Sequence[Lit]) -> None:
        """Only nights that get at least one of these (true) answers wrong are solutions."""
        self.model.add_bool_or([~a for a in answers])

    def solve(self, assumptions: Sequence[Lit]) -> tuple[bool, list[int], Night | None]:
        """(feasible, core as literal keys when infeasible, the night found when feasible)."""
        self.model.clear_assumptions()
        self.model.add_assumptions(list(assumptions))
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1  # parallelism is across puzzles; one worker is deterministic
        # These models are many small solves of mostly-propagation problems: the fixed cost of
        # presolve, probing, symmetry detection and LP relaxation dominates, so switch them off.
        solver.parameters.cp_model_presolve = False
        solver.parameters.linearization_level = 0
        solver.parameters.symmetry_level = 0
        solver.parameters.cp_model_probing_level = 0  # root probing alone cost ~5x a whole solve
        status = solver.solve(self.model)
        if status == cp_model.INFEASIBLE:
            return False, list(solver.sufficient_assumptions_for_infeasibility()), None
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            raise RuntimeError(f"CP-SAT returned {solver.status_name(status)}")
        return True, [], self._night(solver)

    def _night(self, solver: cp_model.CpSolver) -> Night:
        sol = list(solver.response_proto.solution)

        def pick(lits: Sequence[Lit]) -> int:
            return next(i for i, v in enumerate(lits) if sol[v.index])

        s = self.setting
        positions = [[pick(self.x[e][t]) for t in range(s.num_times)] for e in range(s.num_entities)]
        motives = [pick(row) for row in self.motive_vars]
        return Night(positions, motives, pick(self.murderer), pick(self.weapon), pick(self.room), pick(self.time))


@dataclass
class Selection:
    clues: list[Clue]
    # For each kept clue (same order), a rule-abiding night that satisfies every OTHER kept clue
    # yet answers some question differently: the proof that the clue cannot be dropped.
    witnesses: list[Night]
    solves: int = 0
    stats: dict[str, int] = field(default_factory=dict)


def _encode(base: GameModel, clues: Sequence[Clue]) -> tuple[GameModel, list[Lit]]:
    model = base.fork()
    return model, [c.encode(model) for c in clues]


def nearby_nights(setting: Setting, truth: Night) -> list[tuple[int, Night]]:
    """Rule-abiding nights close to `truth`, each with a code for what changed: the entity that
    moved (one time or two consecutive times), -1 for two suspects' motives swapped, or
    -2 - (suspect * num_entities + weapon) for a suspect carrying a weapon to another room. Legality is checked locally (only what the change can break), which keeps
    this cheap; tests confirm every result with the independent `check_rules`."""
    out: list[tuple[int, Night]] = []
    layout, T, S = setting.layout, setting.num_times, setting.num_suspects
    pos, body = truth.positions, setting.boddy
    murder_weapon = setting.weapon_entity(truth.weapon)
    weapons = [setting.weapon_entity(w) for w in range(len(setting.weapons))]

    def carried(positions: list[list[int]], weapon: int, step: int) -> bool:
        a, b = positions[weapon][step - 1], positions[weapon][step]
        return a == b or any(positions[s][step - 1] == a and positions[s][step] == b for s in range(S))

    def allowed(e: int, t: int) -> set[int]:
        """Rooms entity e may take at time t as far as the murder is concerned."""
        if t == truth.time and e in (truth.murderer, murder_weapon, body):
            return set()  # the murder scene itself cannot change
        if e == body and t > truth.time:
            return set()  # the body stays put
        rooms = set(range(setting.num_rooms))
        if t == truth.time and setting.is_suspect(e):
            rooms.discard(truth.room)  # the murderer must stay alone with Mr. Boddy
        return rooms

    for e in range(setting.num_entities):
        path = pos[e]
        touched = [e] if setting.is_weapon(e) else weapons if setting.is_suspect(e) else []
        for t in range(T):
            for span in (1, 2):
                if t + span > T:
                    continue
                # New rooms for times t .. t+span-1, each different from the truth.
                choices: list[list[int]] = [[]]
                for u in range(t, t + span):
                    rooms = allowed(e, u) - {path[u]}
                    choices = [[*c, r] for c in choices for r in sorted(rooms)
                               if r in layout.reachable(c[-1] if c else path[u - 1] if u > 0 else r)]
                end = t + span
                choices = [c for c in choices if end >= T or path[end] in layout.reachable(c[-1])]
                steps = [u for u in range(t, end + 1) if 1 <= u < T]
                for change in choices:
                    positions = list(pos)
                    positions[e] = [*path[:t], *change, *path[end:]]
                    if all(carried(positions, w, u) for w in touched for u in steps):
                        out.append((e, replace(truth, positions=positions)))
    # A suspect and a weapon that shared a room both going to another room (the weapon carried
    # along): weapons rarely move legally on their own.
    for suspect in range(S):
        for w in weapons:
            for t in range(T):
                if pos[w][t] != pos[suspect][t]:
                    continue
                rooms = allowed(suspect, t) & allowed(w, t)
                for near in (t - 1, t + 1):
                    if 0 <= near < T:
                        rooms &= set(layout.reachable(pos[suspect][near])) & set(layout.reachable(pos[w][near]))
                rooms.discard(pos[w][t])
                steps = [u for u in (t, t + 1) if 1 <= u < T]
                for room in sorted(rooms):
                    positions = list(pos)
                    positions[suspect] = [*pos[suspect][:t], room, *pos[suspect][t + 1:]]
                    positions[w] = [*pos[w][:t], room, *pos[w][t + 1:]]
                    if all(carried(positions, v, u) for v in weapons for u in steps):
                        out.append((-2 - suspect * setting.num_entities - w, replace(truth, positions=positions)))
    motives = truth.motives
    for a in range(len(motives)):
        for b in range(a + 1, len(motives)):
            if motives[a] != motives[b]:
                swapped = list(motives)
                swapped[a], swapped[b] = swapped[b], swapped[a]
                out.append((-1, replace(truth, motives=swapped)))
    return out


def depends_on(clue: Clue, setting: Setting, truth: Night) -> set[int]:
    """Entities whose positions a clue reads (with references resolved on the truth)."""
    entities: set[int] = set()
    for atom in clue.atoms:
        entities.update(r.resolve(setting, truth) for r in atom.refs())
        if atom.kind == "count":
            entities.update(range(setting.num_suspects))
    return entities


def _readers(setting: Setting, truth: Night, clues: Sequence[Clue]) -> dict[int, list[Clue]]:
    readers: dict[int, list[Clue]] = {}
    for c in clues:
        for e in depends_on(c, setting, truth):
            readers.setdefault(e, []).append(c)
    return readers


def _readers_of(readers: dict[int, list[Clue]], moved: int, clues: Sequence[Clue], setting: Setting) -> list[Clue]:
    """The clues a change coded as in `nearby_nights` can break: only those reading what moved."""
    if moved >= 0:
        return readers.get(moved, [])
    if moved == -1:
        return list(clues)
    suspect, weapon = divmod(-2 - moved, setting.num_entities)
    return list(dict.fromkeys(readers.get(suspect, []) + readers.get(weapon, [])))


def _unexcluded(setting: Setting, truth: Night, near: Sequence[tuple[int, Night]],
                clues: Sequence[Clue]) -> list[Night]:
    """The nearby nights that satisfy every one of `clues`."""
    readers = _readers(setting, truth, clues)
    return [night for moved, night in near
            if all(c.holds(setting, night) for c in _readers_of(readers, moved, clues, setting))]


def select_clues(setting: Setting, truth: Night, answers: Sequence[Atom], pool: Sequence[Clue],
                 rng: random.Random) -> Selection:
    """An irredundant subset of `pool` (clues true of `truth`) that fixes every answer.

    1. Phase 1 (model with the whole pool): assume all indirect clues (tiers 1-2); rule out the
       nearby nights they let through with one plain fact (tier 0) each, found in Python; then,
       while CP-SAT still finds another night, add some plain facts that night breaks. The final
       infeasible solve's core is re-checked (and repaired if CP-SAT's core falls short).
    2. Phase 2 (a fork of the base model with the core only, because free, unassumed clue
       encodings slow every solve down): try to drop each clue, plain named facts first and
       compound / indirect clues last (one solve first tries dropping all plain facts at once),
       so the clues that survive need reasoning. An infeasible
       try drops it (and shrinks the set to a re-checked core); a feasible one gives a witness
       night proving the clue is needed. Witnesses also come for free from one- and two-change
       variations of the truth checked in Python (`nearby_nights`), which skips most solves.

    Returns the kept clues with one witness night each: it obeys the rules, satisfies every
    other kept clue, breaks this one and gets some answer wrong (tests re-check all of that).
    """
    base = GameModel(setting)
    base.require_differs([a.encode(base) for a in answers])
    near = nearby_nights(setting, truth)
    core = _sufficient_core(setting, truth, base, pool, near, rng)
    final, witnesses, solves, bad_cores = _irredundant(setting, truth, answers, base, core, near)
    stats = {"pool": core.pool, "first_core": len(core.keep), "bad_cores": core.bad_cores + bad_cores}
    return Selection(final, witnesses, solves=core.solves + solves, stats=stats)


@dataclass
class _Core:
    """What phase 1 hands phase 2: a sufficient set of clues, keep-preferred order and counters."""

    keep: list[Clue]
    rank: dict[Clue, tuple[int, float]]
    pool: int
    solves: int
    bad_cores: int


def _sufficient_core(setting: Setting, truth: Night, base: GameModel, pool: Sequence[Clue],
                     near: Any, rng: random.Random) -> _Core:
    """Phase 1 (model with the whole pool): a set of clues that fixes every answer (re-checked core)."""
    model, lits = _encode(base, pool)
    unique: dict[int, tuple[Clue, Lit]] = {}
    for clue, lit in zip(pool, lits):
        unique.setdefault(_key(lit), (clue, lit))  # two clues can say the same thing; keep the first
    rank = {c: (c.tier, rng.random()) for c, _ in unique.values()}
    # Assumptions listed keep-preferred first: the core tends to use the clues we want to keep.
    candidates = sorted(unique.values(), key=lambda cl: (-rank[cl[0]][0], rank[cl[0]][1]))
    # Start from the indirect clues alone; while they leave another answer possible, add a few
    # plain facts that the alternative night breaks (plain facts are strong, so the core would
    # otherwise be made of them).
    assumed = [cl for cl in candidates if cl[0].tier > 0]
    direct = [cl for cl in candidates if cl[0].tier == 0]
    # Nights next to the truth that the indirect clues let through are found in Python first,
    # and each gets one plain fact that rules it out: that saves a solve per such night.
    for night in _unexcluded(setting, truth, near, [c for c, _ in assumed]):
        if all(c.holds(setting, night) for c, _ in assumed):
            broken = [cl for cl in direct if not cl[0].holds(setting, night)]
            if broken:
                pick = broken[int(rng.random() * len(broken))]
                direct.remove(pick)
                assumed.append(pick)
    solves = bad_cores = 0
    while True:
        feasible, core, night = model.solve([lit for _, lit in assumed])
        solves += 1
        if not feasible:
            break
        assert night is not None
        broken = [cl for cl in direct if not cl[0].holds(setting, night)]
        if not broken:
            raise RuntimeError("the candidate clues do not determine the answers")
        rng.shuffle(broken)
        chosen = broken[: max(1, int(len(broken) * ADD_FRACTION))]
        direct = [cl for cl in direct if cl not in chosen]
        assumed += chosen
    # CP-SAT's "sufficient assumptions" are occasionally not sufficient (seen with presolve and
    # probing off), so every core is re-checked; a short one is repaired by adding back the
    # assumed clues that the night it lets through breaks, keep-preferred first.
    in_core = set(core)
    chosen_set = {c for c, lit in assumed if _key(lit) in in_core}
    while True:
        feasible, _, night = model.solve([lit for c, lit in assumed if c in chosen_set])
        solves += 1
        if not feasible:
            break
        assert night is not None
        bad_cores += 1
        missing = [c for c, _ in assumed if c not in chosen_set and not c.holds(setting, night)]
        if not missing:
            raise RuntimeError("an alternative night satisfies every assumed clue")
        chosen_set.update(missing[:2])
    keep = [c for c, _ in candidates if c in chosen_set]
    return _Core(keep, rank, len(candidates), solves, bad_cores)


def _irredundant(setting: Setting, truth: Night, answers: Sequence[Atom], base: GameModel, core: _Core,
                 near: Any) -> tuple[list[Clue], list[Night], int, int]:
    """Phase 2 (a model with the core only): drop every clue not needed; a witness night for each kept.

    Returns (kept clues, their witness nights, solves, bad cores)."""
    keep, rank = core.keep, core.rank
    solves = bad_cores = 0
    model, lits = _encode(base, keep)
    lit_of = dict(zip(keep, lits))
    clue_of = {_key(lit): c for c, lit in lit_of.items()}
    kept = set(keep)
    witnesses: dict[Clue, Night] = {}
    # Alternative nights and the kept clues each breaks. Seeded with rule-abiding one-change
    # variations of the truth: each that breaks a single kept clue proves that clue needed
    # without a solve (most kept clues get their proof this way on larger puzzles).
    found: list[tuple[Night, set[Clue]]] = []
    readers = _readers(setting, truth, keep)
    for moved, night in near:
        broken: set[Clue] = set()
        for c in _readers_of(readers, moved, keep, setting):
            if not c.holds(setting, night):
                broken.add(c)
                if len(broken) > 1:
                    break
        if len(broken) == 1 and not all(a.holds(setting, night) for a in answers):
            found.append((night, broken))
    # Plain facts are tried for removal first; one solve can often drop them all at once.
    plain = [c for c in keep if c.tier == 0]
    if len(plain) > 1:
        rest = [c for c in keep if c.tier > 0]
        feasible, core, _ = model.solve([lit_of[c] for c in rest])
        solves += 1
        if not feasible:
            kept = set(rest)
    for clue in sorted(keep, key=lambda c: rank[c]):
        if clue not in kept:
            continue
        # A night found earlier that breaks only this clue among those kept proves it is needed.
        cached = next((night for night, broken in found if clue in broken and len(broken & kept) == 1), None)
        if cached is not None:
            witnesses[clue] = cached
            continue
        rest = [c for c in keep if c in kept and c is not clue]
        feasible, core, night = model.solve([lit_of[c] for c in rest])
        solves += 1
        if feasible:
            assert night is not None
            witnesses[clue] = night
            found.append((night, {c for c in kept if not c.holds(setting, night)}))
        else:
            kept = set(rest)
            smaller = {clue_of[k] for k in core}
            if len(smaller) < len(rest):
                solves += 1
                if not model.solve([lit_of[c] for c in keep if c in smaller])[0]:
                    kept = smaller
                else:
                    bad_cores += 1
    final = [c for c in keep if c in kept]
    return final, [witnesses[c] for c in final], solves, bad_cores
