"""Short deductions written by the solver: why each answer of a puzzle holds, in solver order.

For every question, one line such as

    A: clue 4: Mr. Boddy was in the Courtyard at 12:00 AM; clues 2, 6: the Rope was in the Lounge
       at 12:00 AM => Lounge   (one line in the text)

built on the puzzle's CP-SAT model (`solver.GameModel`, the rules only, no uniqueness constraint):

1. *Which clues*: a minimal set of the puzzle's clues that, with the rules, forces the answer.
   One solve with every clue assumed and the answer negated is infeasible; its core is then
   shrunk clue by clue (a clue is dropped when the rest still force the answer), so the set is
   irredundant and re-checked by the solver, never taken on trust from a core.
2. *In what order*: the questions share one chain of steps. A question's clues not used by an
   earlier line are added one at a time, in prompt order, taking the first one that, with the
   clues already used, forces a new fact of the hidden night (a position, a motive, a fact of the
   murder, or the answer itself); a clue that forces nothing new alone is held back and cited
   together with the next one that does ("clues 2, 6"). This is successive elimination as a
   reader would do it. An answer that the clues used so far already force gets a short line
   citing just a minimal set of them ("C: clues 4, 5, 6 => Lounge").
3. *What it says*: each step names its clue numbers (1-based, the order the prompt lists them)
   and at most `FACTS_PER_STEP` of the facts it newly forces (facts about things later clues or
   the question mention first); the line ends with `=> ANSWER`.

Every stated fact is forced by the clues cited up to that point (so it is true of the hidden
night), and the clues cited on a line and the lines before it force that line's answer:
tests/test_deduce.py re-checks both with a fresh solver model. The text depends only on the puzzle (the solver runs on one
worker, deterministically).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sleuth.tasks.temporal_clue.clues import Atom
from sleuth.tasks.temporal_clue.game import Night, Setting
from sleuth.tasks.temporal_clue.generate import Puzzle, whole_night
from sleuth.tasks.temporal_clue.prompt import Question
from sleuth.tasks.temporal_clue.solver import GameModel, Lit, depends_on

FACTS_PER_STEP = 2
"""Newly forced facts a step states at most (the answer always counts as one of them)."""
DEDUCTIONS_HEADER = "Deductions:"
"""The line that opens the deduction block of a `deduce` completion."""
ANSWERS_HEADER = "Answers:"
"""The line after which a `deduce` completion writes its answer sheet (the grader reads only that)."""


@dataclass(frozen=True)
class Step:
    clues: tuple[int, ...]  # indices into the puzzle's prompt-order clue list
    facts: tuple[Atom, ...]  # facts these clues (with the earlier steps') newly force, in the order stated


@dataclass(frozen=True)
class Deduction:
    letter: str
    question: Question
    steps: tuple[Step, ...]

    @property
    def cited(self) -> list[int]:
        return [i for step in self.steps for i in step.clues]

    def text(self, setting: Setting) -> str:
        parts = []
        for step in self.steps:
            label = "clue" if len(step.clues) == 1 else "clues"
            numbers = ", ".join(str(i + 1) for i in step.clues)
            facts = [f.text(setting) for f in step.facts if f != self.question.atom]
            parts.append(f"{label} {numbers}: {'; '.join(facts)}" if facts else f"{label} {numbers}")
        return f"{self.letter}: {'; '.join(parts)} => {self.question.answer}"


class _Prover:
    """One puzzle's model with every clue, fact and question atom encoded once."""

    def __init__(self, puzzle: Puzzle) -> None:
        self.setting, self.night, self.clues = puzzle.setting, puzzle.night, list(puzzle.clues)
        self.model = GameModel(puzzle.setting)
        self.clue_lits = [c.encode(self.model) for c in puzzle.clues]
        self.facts = whole_night(puzzle.setting, puzzle.night)
        self.fact_lits = {f: f.encode(self.model) for f in self.facts}

    def lit(self, atom: Atom) -> Lit:
        if atom not in self.fact_lits:
            self.fact_lits[atom] = atom.encode(self.model)
        return self.fact_lits[atom]

    def entails(self, clues: Sequence[int], atom: Atom) -> bool:
        feasible, _, _ = self.model.solve([*(self.clue_lits[i] for i in clues), ~self.lit(atom)])
        return not feasible

    def forced(self, clues: Sequence[int], candidates: Sequence[Atom]) -> list[Atom]:
        """The candidates (all true of the hidden night) that `clues` force. A night found while
        testing one candidate rules out, without a solve, every candidate it contradicts."""
        unknown, out = list(candidates), []
        while unknown:
            atom = unknown.pop(0)
            feasible, _, night = self.model.solve([*(self.clue_lits[i] for i in clues), ~self.lit(atom)])
            if not feasible:
                out.append(atom)
            else:
                assert night is not None
                unknown = [a for a in unknown if a.holds(self.setting, night)]
        return out

    def minimal_support(self, atom: Atom, among: Sequence[int] | None = None) -> list[int]:
        """An irredundant set of clue indices (ascending), taken from `among` (default: all),
        that forces `atom`."""
        everything = sorted(among) if among is not None else list(range(len(self.clue_lits)))
        feasible, core, _ = self.model.solve([*(self.clue_lits[i] for i in everything), ~self.lit(atom)])
        if feasible:
            raise RuntimeError("the puzzle's clues do not force this answer")
        index_of = {int(lit.index): i for i, lit in enumerate(self.clue_lits)}
        support = sorted({index_of[k] for k in core if k in index_of})
        if not self.entails(support, atom):  # a short core (seen with presolve off): start from all
            support = everything
        # Drop compound and indirect clues first, so the plain facts a reader checks fastest stay.
        for i in sorted(support, key=lambda i: -self.clues[i].tier):
            rest = [j for j in support if j != i]
            if self.entails(rest, atom):
                support = rest
        return support


def _relevant_first(facts: list[Atom], answer: Atom, later: set[int], setting: Setting, night: Night) -> list[Atom]:
    """The answer, then facts about things that later clues or the question read, then the rest."""
    def rank(fact: Atom) -> int:
        if fact == answer:
            return 0
        refs = {r.resolve(setting, night) for r in fact.refs()}
        return 1 if refs & later else 2
    return sorted(facts, key=rank)


class _Chain:
    """The puzzle's deduction so far: clues used (in order) and the facts they force."""

    def __init__(self, prover: _Prover) -> None:
        self.prover = prover
        self.used: list[int] = []
        self.facts = list(prover.facts)
        self.known: set[Atom] = set(prover.forced([], self.facts))  # what the rules alone force

    def extend(self, support: list[int], answer: Atom) -> list[Step]:
        """Steps that add the clues of `support` not used yet, until `answer` is forced."""
        prover, setting, night, clues = self.prover, self.prover.setting, self.prover.night, self.prover.clues
        candidates = [answer, *(f for f in self.facts if f != answer)]
        remaining = [i for i in support if i not in self.used]
        pending: list[int] = []
        steps: list[Step] = []
        while remaining and answer not in self.known:
            found = None
            for i in remaining:
                new = prover.forced([*self.used, *pending, i], [c for c in candidates if c not in self.known])
                if new:
                    found = (i, new)
                    break
            if found is None:
                pending.append(remaining.pop(0))
                continue
            i, new = found
            remaining.remove(i)
            group = [*pending, i]
            self.used += group
            pending = []
            self.known.update(new)
            later: set[int] = set().union(*(depends_on(clues[j], setting, night) for j in remaining),
                                          {r.resolve(setting, night) for r in answer.refs()})
            shown = _relevant_first(new, answer, later, setting, night)[:FACTS_PER_STEP]
            steps.append(Step(tuple(group), tuple(shown)))
        return steps


def deduce(puzzle: Puzzle) -> list[Deduction]:
    """One deduction per question, in question order (letters A, B, ...). The questions share one
    chain: a line adds only the steps its answer needs beyond the earlier lines'; an answer the
    earlier clues already force gets a line citing just its (minimal) supporting clues."""
    prover = _Prover(puzzle)
    chain = _Chain(prover)
    out = []
    for i, question in enumerate(puzzle.questions):
        answer = question.atom
        if prover.entails(chain.used, answer):
            steps = [Step(tuple(prover.minimal_support(answer, chain.used)), ())]
        else:
            steps = chain.extend(prover.minimal_support(answer), answer)
        out.append(Deduction(chr(ord("A") + i), question, tuple(steps)))
    return out


def deduction_text(puzzle: Puzzle) -> str:
    """The deduction block: the header, then one line per question."""
    return "\n".join([DEDUCTIONS_HEADER, *(d.text(puzzle.setting) for d in deduce(puzzle))])


def solution_text(puzzle: Puzzle) -> str:
    """What a `deduce` completion should be: the deductions, then the answer sheet."""
    sheet = [f"{chr(ord('A') + i)}. {q.answer}" for i, q in enumerate(puzzle.questions)]
    return "\n".join([deduction_text(puzzle), ANSWERS_HEADER, *sheet])
