"""Shared-prompt packing: each group's prompt is computed once and its completions follow it.

A packed row is `[prompt A | a1 | a2 | ... | prompt B | b1 | ...]` (padding only at the row end).
Every token carries a segment id (which prompt instance it belongs to) and a completion id (0 for
prompt tokens, a row-unique id >= 1 for completion tokens). A token may attend to an earlier token
of the same segment that is either a prompt token or a token of its own completion, which makes
each completion see exactly `[its prompt | itself]`; position ids restart at the prompt length
for every completion, so the model computes the same function as on separate sequences.

Rows are filled to `row_tokens` by first-fit decreasing. A group larger than one row is split
into parts, each repeating the prompt. A single prompt + completion longer than the budget gets
a row of its own (the budget is a memory target, not a correctness limit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from sleuth.errors import UserError
from sleuth.records import Group


@dataclass(frozen=True)
class Placement:
    """Where one completion sits in a packed row."""

    seq: int
    """Global completion index in the batch: groups in input order, completions in group order."""
    group: int
    completion: int
    prompt_start: int
    prompt_len: int
    start: int
    """Row position of the completion's first token."""
    length: int


@dataclass
class PackedRow:
    """One forward pass worth of tokens, with per-target-token training data."""

    input_ids: torch.Tensor
    """[T] token ids."""
    position_ids: torch.Tensor
    """[T] positions: 0.. over the prompt, continuing from the prompt length for each completion."""
    segment_ids: torch.Tensor
    """[T] prompt instance of each token (-1 for padding)."""
    completion_ids: torch.Tensor
    """[T] 0 for prompt and padding tokens, row-unique id >= 1 for completion tokens."""
    predictor_index: torch.Tensor
    """[N] row position whose hidden state predicts each completion token (the last prompt token
    for a completion's first token, the previous completion token otherwise)."""
    target_ids: torch.Tensor
    """[N] the sampled completion tokens."""
    token_seq: torch.Tensor
    """[N] global completion index (Placement.seq) of each target token."""
    engine_logprobs: torch.Tensor
    """[N] the rollout engine's logprob of each sampled token (float32)."""
    advantages: torch.Tensor
    """[N] the completion's advantage, repeated over its tokens (float32)."""
    placements: list[Placement] = field(default_factory=list)

    @property
    def length(self) -> int:
        return int(self.input_ids.numel())

    @property
    def n_real_tokens(self) -> int:
        return int((self.segment_ids >= 0).sum())


@dataclass
class PackedBatch:
    rows: list[PackedRow]
    seq_lengths: torch.Tensor
    """[S] completion length of every sequence (indexed by Placement.seq)."""
    n_tokens: int
    """Non-padding tokens over all rows (prompts counted once per row part)."""

    @property
    def n_seqs(self) -> int:
        return int(self.seq_lengths.numel())

    @property
    def n_completion_tokens(self) -> int:
        return int(self.seq_lengths.sum())


def validate_groups(groups: list[Group]) -> None:
    """Raise UserError naming the first malformed group or completion."""
    for g, group in enumerate(groups):
        name = f"group {g} ({group.problem.id})"
        if not group.completions:
            raise UserError(f"{name} has no completions")
        if not group.prompt_ids:
            raise UserError(f"{name} has an empty prompt")
        if group.advantages is None:
            raise UserError(f"{name} has no advantages: call compute_advantages first")
        if len(group.advantages) != len(group.completions):
            raise UserError(
                f"{name} has {len(group.advantages)} advantages for {len(group.completions)} completions"
            )
        if not all(math.isfinite(a) for a in group.advantages):
            raise UserError(f"{name} has a non-finite advantage")
        for c, comp in enumerate(group.completions):
            where = f"{name} completion {c}"
            if not comp.completion_ids:
                raise UserError(f"{where} has no tokens")
            if len(comp.logprobs) != len(comp.completion_ids):
                raise UserError(
                    f"{where} has {len(comp.logprobs)} logprobs for {len(comp.completion_ids)} tokens"
                )
            if not all(math.isfinite(x) for x in comp.logprobs):
                raise UserError(f"{where} has a non-finite (NaN/inf) engine logprob")
            if comp.prompt_ids and comp.prompt_ids != group.prompt_ids:
                raise UserError(f"{where} was sampled from a different prompt than its group's")


def _split_group(prompt_len: int, lengths: list[int], budget: int) -> list[list[int]]:
    """Completion indices per part so that prompt + part fits the budget (first-fit decreasing)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    parts: list[list[int]] = []
    used: list[int] = []
    for i in order:
        for p, size in enumerate(used):
            if size + lengths[i] <= budget:
                parts[p].append(i)
                used[p] += lengths[i]
                break
        else:
            parts.append([i])
            used.append(prompt_len + lengths[i])
    return [sorted(p) for p in parts]


def pack_groups(groups: list[Group], row_tokens: int, pad_to_multiple: int = 1, pad_id: int = 0) -> PackedBatch:
    """Pack groups (with advantages set) into rows of at most row_tokens tokens."""
    validate_groups(groups)
    if row_tokens < 1:
        raise UserError(f"row_tokens must be positive, got {row_tokens}")
    seq_offset: list[int] = []
    total = 0
    for group in groups:
        seq_offset.append(total)
        total += len(group.completions)
    # Parts: (size, group index, completion indices); then first-fit decreasing into rows.
    parts: list[tuple[int, int, list[int]]] = []
    for g, group in enumerate(groups):
        lengths = [len(c.completion_ids) for c in group.completions]
        for idx in _split_group(len(group.prompt_ids), lengths, row_tokens):
            parts.append((len(group.prompt_ids) + sum(lengths[i] for i in idx), g, idx))
    parts.sort(key=lambda p: (-p[0], p[1]))
    bins: list[list[tuple[int, int, list[int]]]] = []
    fill: list[int] = []
    for part in parts:
        for b, used in enumerate(fill):
            if used + part[0] <= row_tokens:
                bins[b].append(part)
                fill[b] += part[0]
                break
        else:
            bins.append([part])
            fill.append(part[0])
    rows = [_build_row(groups, parts_in_row, seq_offset, pad_to_multiple, pad_id) for parts_in_row in bins]
    seq_lengths = torch.tensor(
        [len(c.completion_ids) for group in groups for c in group.completions], dtype=torch.long
    )
    return PackedBatch(rows=rows, seq_lengths=seq_lengths, n_tokens=sum(fill))


def _build_row(
    groups: list[Group], parts: list[tuple[int, int, list[int]]], seq_offset: list[int],
    pad_to_multiple: int, pad_id: int,
) -> PackedRow:
    ids: list[int] = []
    pos: list[int] = []
    seg: list[int] = []
    comp_id: list[int] = []
    predictor: list[int] = []
    targets: list[int] = []
    token_seq: list[int] = []
    engine: list[float] = []
    adv: list[float] = []
    placements: list[Placement] = []
    next_comp = 1
    for s, (_, g, idx) in enumerate(parts):
        group = groups[g]
        assert group.advantages is not None
        prompt_start, plen = len(ids), len(group.prompt_ids)
        ids.extend(group.prompt_ids)
        pos.extend(range(plen))
        seg.extend([s] * plen)
        comp_id.extend([0] * plen)
        for c in idx:
            comp = group.completions[c]
            n = len(comp.completion_ids)
            start = len(ids)
            ids.extend(comp.completion_ids)
            pos.extend(range(plen, plen + n))
            seg.extend([s] * n)
            comp_id.extend([next_comp] * n)
            next_comp += 1
            predictor.append(prompt_start + plen - 1)
            predictor.extend(range(start, start + n - 1))
            targets.extend(comp.completion_ids)
            seq = seq_offset[g] + c
            token_seq.extend([seq] * n)
            engine.extend(comp.logprobs)
            adv.extend([float(group.advantages[c])] * n)
            placements.append(Placement(seq, g, c, prompt_start, plen, start, n))
    pad = (-len(ids)) % pad_to_multiple
    ids.extend([pad_id] * pad)
    pos.extend([0] * pad)
    seg.extend([-1] * pad)
    comp_id.extend([0] * pad)

    def long(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long)

    return PackedRow(
        input_ids=long(ids), position_ids=long(pos), segment_ids=long(seg), completion_ids=long(comp_id),
        predictor_index=long(predictor), target_ids=long(targets), token_seq=long(token_seq),
        engine_logprobs=torch.tensor(engine, dtype=torch.float32),
        advantages=torch.tensor(adv, dtype=torch.float32), placements=placements,
    )
