"""Puzzle text in the published Temporal Clue shape: story, cast, map, times, motives, rules,
clues, questions and the answer sheet to fill in.

The ladder's rungs (one time, plain-fact clues, ladder.py) are written compactly: a one-line story,
the lists under short headers, no map (no rung clue is about directions) and no sign-off. The
sections every reader of a prompt looks for (the lists, the clue header, the questions, the answer
format: dataset.py, reasoning.py, diagnostics.py) are the same in both forms. A rung prompt is a
fifth shorter (`elim1` in deduce form with SmolLM2's chat template: 529 -> 424 tokens on average),
and on a CPU the evaluations and the warm start's steps are bound by prompt tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sleuth.tasks.temporal_clue.clues import Atom, Clue
from sleuth.tasks.temporal_clue.dataset import DESCRIBED
from sleuth.tasks.temporal_clue.game import Setting

INTRO = (
    "On a cold and rainy night, the wealthy and secretive Mr. John Q. Boddy invited a handful of close "
    "acquaintances to a quiet dinner at Tudor Mansion. By morning the party was over: Mr. Boddy was found "
    "dead in one of the mansion's rooms. The following persons of interest have been identified as suspects:"
)
COMPACT_INTRO = "Mr. Boddy was found dead in one of the rooms of Tudor Mansion."
CHOICES_SUFFIX = " (choose from: {})"


@dataclass(frozen=True)
class Question:
    text: str  # "Where was Mr. Green at 11:00 PM?"
    answer: str  # "Kitchen"
    placeholder: str  # SUSPECT, WEAPON, ROOM, TIME or MOTIVE (the answer-sheet line)
    choices: tuple[str, ...]  # every valid answer of this type
    atom: Atom  # the statement "the answer is <answer>", true of the hidden night
    bonus: bool = False


def render_map(setting: Setting) -> list[str]:
    """The grid with room numbers, N/S/W/E around it and '-' in empty cells."""
    layout = setting.layout
    width = len(str(len(layout.rooms)))
    lines = ["  " + " ".join("N" * width for _ in range(layout.cols)) + "  "]
    for row in range(layout.rows):
        cells = []
        for col in range(layout.cols):
            room = layout.room_at(row, col)
            cells.append("-" if room is None else f"{room + 1:0{width}d}")
        lines.append(f"W {'|'.join(cells)} E")
    lines.append("  " + " ".join("S" * width for _ in range(layout.cols)) + "  ")
    return lines


def bullets(items: Sequence[str]) -> list[str]:
    return [f"• {item}" for item in items]


def render_prompt(setting: Setting, clues: Sequence[Clue], questions: Sequence[Question],
                  list_choices: bool = False, compact: bool = False) -> str:
    """The full puzzle text; questions are lettered A, B, ... in the order given. `compact`: the
    rungs' short form (module docstring), for one-time puzzles without spatial clues."""
    width = len(str(setting.num_rooms))
    rooms = [f"{i + 1:0{width}d}. {name}" for i, name in enumerate(setting.layout.rooms)]
    if compact:
        lines = [COMPACT_INTRO, "", "Suspects:", *bullets(setting.suspects), "", "Weapons:", *bullets(setting.weapons),
                 "", "Rooms:", *rooms, ""]
    else:
        lines = [INTRO, "", *bullets(setting.suspects), "", "And the following weapons were found on the premises:",
                 "", *bullets(setting.weapons), "", "The murder could only have occurred in one of the following rooms:",
                 "", *rooms, "", "The rooms are laid out as follows:", "", *render_map(setting), ""]
    several_times = setting.num_times > 1
    if several_times:
        lines += ["The exact time of the murder is a bit uncertain, but it has been narrowed down to one of "
                  "the following times:", "", *bullets(setting.times), "",
                  "At every time the suspects and Mr. Boddy either stayed in their current room or moved to an "
                  "orthogonally adjacent room (north, south, east, or west). Weapons could be moved by suspects "
                  "between rooms as well: a weapon only moved when a suspect carried it, making the same move. "
                  "After the murder, Mr. Boddy's body stayed in the room where he was killed.", ""]
    if setting.motives:
        items = list(setting.motives)
        if setting.unique_motives:
            header = ("Motives (each suspect had a different one):" if compact else
                      "Each suspect uniquely had one of the following possible motives for killing Mr. Boddy:")
        else:
            assert setting.motive_counts is not None
            items = [f"{m} ({c} suspect{'s' if c > 1 else ''})" for m, c in zip(setting.motives, setting.motive_counts)]
            header = ("Motives (each suspect had one):" if compact else
                      "Each suspect had one of the following possible motives for killing Mr. Boddy:")
        lines += [header, *([] if compact else [""]), *bullets(items), ""]
    rule = ("For the murder to occur, the murderer and Mr. Boddy must have been alone in a room with at least one "
            "weapon")
    if several_times:
        rule += (" at some point in the night. Any clue about Mr. Boddy's whereabouts should be read as "
                 "\"Mr. Boddy (dead or alive) ...\"")
    else:
        rule += "."
    lines += [rule, "", "The available clues are as follows:", ""]
    lines += [f"- {clue.text(setting)}" for clue in clues]
    letters = [chr(ord("A") + i) for i in range(len(questions))]

    def question_line(i: int) -> str:
        q = questions[i]
        suffix = CHOICES_SUFFIX.format(", ".join(q.choices)) if list_choices else ""
        return f"{letters[i]}. {q.text}{suffix}"

    main = [i for i, q in enumerate(questions) if not q.bonus]
    bonus = [i for i, q in enumerate(questions) if q.bonus]
    lines += ["", "Please answer the following question(s):", "", *(question_line(i) for i in main)]
    if bonus:
        lines += ["", "And the following bonus question(s):", "", *(question_line(i) for i in bonus)]
    lines += ["", "Fill out your final answers in the following format:", ""]
    # With the choices listed the sheet also says what goes on each line (`<name of the suspect>`):
    # a small model copies bare placeholders (`A. SUSPECT`) verbatim (see dataset.DESCRIBED).
    lines += [f"{letters[i]}. {DESCRIBED[q.placeholder] if list_choices else q.placeholder}"
              for i, q in enumerate(questions)]
    if not compact:
        lines += ["", "Best of luck, detective."]
    return "\n".join(lines)
