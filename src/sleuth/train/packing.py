"""Prefix-tree packing: the token prefixes a group's sequences share are computed once.

A sequence is one completion's full token list: its prompt_ids (the group's prompt when it has
none of its own) followed by its completion_ids. A group's sequences form a prefix tree: a node
is a span of tokens that every sequence through it shares, its children are where those
sequences diverge. For single-turn groups (one prompt, n completions) the tree is a root (the
prompt, plus any first tokens all completions share) with one leaf per completion, the layout
`[prompt | c1 | c2 ...]`; multi-turn episodes that diverge after some shared turns, or calls with
their own prompts, give deeper trees and several roots.

Row layout: trees one after another, each depth first: a node's span, then its leaf children
back to back, then each other child followed by its own subtree. Every node's subtree is thus one
contiguous range [start, scope_end) of the row, and the attention rule is one comparison per key:

    query i may attend key j  <=>  j <= i < scope_end[j]

that is, j lies on i's path from its root (an ancestor span, or earlier in i's own span). Position
ids count along each path, so every sequence sees exactly its own tokens at their own positions
and the model computes the same function as on separate sequences.

Targets: every completion token with loss_mask 1 (all of them without a mask), predicted by the
sequence's previous token wherever it lies on the path. A token shared by several sequences is a
target once per sequence (with that sequence's advantage). Tokens with loss_mask 0 (tool results,
user turns, template tokens) are inputs only: no target, hence no loss, no gradient, and they are
not counted by the aggregation (PackedBatch.seq_lengths counts targets).

Rows are filled to `row_tokens` by first-fit decreasing. A group larger than one row is split
into parts (first-fit decreasing over its sequences, each costing the tokens its path adds to the
part), each part repeating the spans its sequences share. A sequence longer than the budget gets
a row of its own (the budget is a memory target, not a correctness limit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from sleuth.errors import UserError
from sleuth.records import Completion, Group

MIN_SHARED = 16
"""Below the root span of a tree (always shared: a single-turn prompt may be short), a span is
shared only from this many tokens on: each shared span costs the CPU attention one more call per
layer (and a copy of its path's keys), more than a few tokens of compute. Shorter spans are
repeated in each branch."""


@dataclass(frozen=True)
class Placement:
    """Where one sequence (a completion with its prompt) sits in a packed row."""

    seq: int
    """Global sequence index in the batch: groups in input order, completions in group order."""
    group: int
    completion: int
    positions: tuple[int, ...]
    """Row position of each token of the sequence (prompt, then completion)."""
    prompt_len: int
    depth: int
    """Tree nodes on the sequence's path (2 for a completion below its shared prompt)."""
    n_targets: int
    """Target tokens of the sequence (its loss-mask ones); its slice of the row's target arrays."""


@dataclass(frozen=True)
class RowNode:
    """One span of a row's prefix trees; nodes are listed in row order."""

    start: int
    length: int
    parent: int
    """Index of the parent node in PackedRow.nodes, -1 for a root."""


@dataclass
class PackedRow:
    """One forward pass worth of tokens, with per-target-token training data."""

    input_ids: torch.Tensor
    """[T] token ids."""
    position_ids: torch.Tensor
    """[T] each token's index in its sequences (0 at every root)."""
    segment_ids: torch.Tensor
    """[T] prefix tree of each token (-1 for padding)."""
    scope_end: torch.Tensor
    """[T] end of the row range that may attend this token: its node's subtree (padding: itself)."""
    predictor_index: torch.Tensor
    """[N] row position whose hidden state predicts each target token."""
    target_ids: torch.Tensor
    """[N] the sampled tokens (loss-mask ones), placement by placement."""
    token_seq: torch.Tensor
    """[N] global sequence index (Placement.seq) of each target token."""
    engine_logprobs: torch.Tensor
    """[N] the rollout engine's logprob of each target token (float32)."""
    advantages: torch.Tensor
    """[N] the sequence's advantage, repeated over its targets (float32)."""
    token_bitmask: torch.Tensor | None = None
    """[N, W] int32 tokens the grammar allowed at each target (Completion.token_bitmask; all bits
    set for a completion without one), or None when no completion of the row has one."""
    guided: torch.Tensor | None = None
    """[N] bool: the target belongs to a guided sample (Completion.guided, rollout.guided_samples),
    or None when no completion of the row is guided."""
    placements: list[Placement] = field(default_factory=list)
    nodes: list[RowNode] = field(default_factory=list)

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
    """[S] target (loss) tokens of every sequence (indexed by Placement.seq)."""
    n_tokens: int
    """Non-padding tokens over all rows (shared spans counted once per row part)."""

    @property
    def n_seqs(self) -> int:
        return int(self.seq_lengths.numel())

    @property
    def n_completion_tokens(self) -> int:
        """Target (sampled, loss-mask one) tokens over all sequences."""
        return int(self.seq_lengths.sum())


def prompt_of(group: Group, comp: Completion) -> list[int]:
    """The prompt a completion was sampled from: its own, else (single-turn records) the group's."""
    return comp.prompt_ids or group.prompt_ids


def sequence(group: Group, comp: Completion) -> list[int]:
    """The completion's full token list: its prompt, then its tokens."""
    return prompt_of(group, comp) + comp.completion_ids


def loss_mask(comp: Completion) -> list[int]:
    return comp.loss_mask if comp.loss_mask is not None else [1] * len(comp.completion_ids)


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
        for j, c in enumerate(group.completions):
            t = c.token_advantages
            if t is not None and (len(t) != len(c.completion_ids) or not all(math.isfinite(a) for a in t)):
                raise UserError(f"{name} completion {j}: token_advantages must be {len(c.completion_ids)} finite "
                                f"numbers, one per completion token")
        for c, comp in enumerate(group.completions):
            _validate_completion(comp, f"{name} completion {c}")


def _validate_completion(comp: Completion, where: str) -> None:
    n = len(comp.completion_ids)
    if not n:
        raise UserError(f"{where} has no tokens")
    if len(comp.logprobs) != n:
        raise UserError(f"{where} has {len(comp.logprobs)} logprobs for {n} tokens")
    if not all(math.isfinite(x) for x in comp.logprobs):
        raise UserError(f"{where} has a non-finite (NaN/inf) engine logprob")
    bm = comp.token_bitmask
    if bm is not None and (not isinstance(bm, torch.Tensor) or bm.dtype != torch.int32 or bm.dim() != 2
                           or bm.shape[0] != n):
        raise UserError(f"{where} has a token_bitmask that is not an int32 tensor of {n} rows")
    if comp.loss_mask is not None:
        if len(comp.loss_mask) != n:
            raise UserError(f"{where} has a loss_mask of {len(comp.loss_mask)} entries for {n} tokens")
        if any(m not in (0, 1) for m in comp.loss_mask):
            raise UserError(f"{where} has a loss_mask entry other than 0 or 1")
        if not any(comp.loss_mask):
            raise UserError(f"{where} has no sampled token (its loss_mask is all 0)")


# ------------------------------------------------------------------ the prefix tree of a group


@dataclass
class _Node:
    """Tokens [depth, end) shared by the sequences `seqs` (local indices, ascending)."""

    depth: int
    end: int
    seqs: list[int]
    children: list[_Node] = field(default_factory=list)

    @property
    def size(self) -> int:
        return self.end - self.depth


def _common_len(seqs: list[list[int]], members: list[int], depth: int) -> int:
    """Length of the prefix all members share from `depth` on (that of the lexicographic extremes)."""
    tails = [seqs[m][depth:] for m in members]
    lo, hi = min(tails), max(tails)
    n = 0
    for a, b in zip(lo, hi):
        if a != b:
            break
        n += 1
    return n


def _by_next_token(seqs: list[list[int]], members: list[int], at: int) -> list[list[int]]:
    """Members ending at `at` (one branch), then the others by their token at `at`."""
    ended = [m for m in members if len(seqs[m]) == at]
    branches: dict[int, list[int]] = {}
    for m in members:
        if len(seqs[m]) > at:
            branches.setdefault(seqs[m][at], []).append(m)
    return ([ended] if ended else []) + list(branches.values())


def _subtrees(seqs: list[list[int]], members: list[int], depth: int) -> list[_Node]:
    """Nodes from `depth` on for members that share tokens [0, depth) and all have more than depth."""
    end = depth + _common_len(seqs, members, depth)
    branches = _by_next_token(seqs, members, end)
    if depth > 0 and len(branches) > 1 and end - depth < MIN_SHARED:
        # Too short to share: each branch (a strict subset) gets its own copy of these tokens.
        return [n for branch in branches for n in _subtrees(seqs, branch, depth)]
    node = _Node(depth, end, sorted(members))
    for branch in branches:
        if len(seqs[branch[0]]) > end:
            node.children.extend(_subtrees(seqs, branch, end))
    return [node]


def prefix_forest(seqs: list[list[int]]) -> list[_Node]:
    """The prefix trees of a group's sequences: one per distinct first token."""
    return [n for branch in _by_next_token(seqs, list(range(len(seqs))), 0) for n in _subtrees(seqs, branch, 0)]


def _paths(forest: list[_Node], n_seqs: int) -> list[list[_Node]]:
    """Each sequence's nodes from its root to the node where it ends."""
    paths: list[list[_Node]] = [[] for _ in range(n_seqs)]

    def visit(node: _Node) -> None:
        for s in node.seqs:
            paths[s].append(node)
        for child in node.children:
            visit(child)

    for root in forest:
        visit(root)
    return paths


def _induced(forest: list[_Node], keep: set[int]) -> list[_Node]:
    """The forest restricted to the sequences in `keep` (nodes none of them pass through dropped)."""
    out = []
    for node in forest:
        seqs = [s for s in node.seqs if s in keep]
        if seqs:
            out.append(_Node(node.depth, node.end, seqs, _induced(node.children, keep)))
    return out


def _split_group(paths: list[list[_Node]], budget: int) -> list[tuple[int, list[int]]]:
    """(tokens, sequence indices) per part: first-fit decreasing, a sequence costing the tokens of
    its path the part does not hold yet."""
    lengths = [path[-1].end for path in paths]
    order = sorted(range(len(paths)), key=lambda i: -lengths[i])
    parts: list[tuple[set[int], list[int]]] = []  # (ids of nodes held, sequences)
    used: list[int] = []
    for i in order:
        for p, (held, members) in enumerate(parts):
            extra = sum(node.size for node in paths[i] if id(node) not in held)
            if used[p] + extra <= budget:
                held.update(id(node) for node in paths[i])
                members.append(i)
                used[p] += extra
                break
        else:
            parts.append(({id(node) for node in paths[i]}, [i]))
            used.append(lengths[i])
    return [(used[p], sorted(members)) for p, (_, members) in enumerate(parts)]


# ------------------------------------------------------------------ rows


def pack_groups(groups: list[Group], row_tokens: int, pad_to_multiple: int = 1, pad_id: int = 0,
                one_per_row: bool = False) -> PackedBatch:
    """Pack groups (with advantages set) into rows of at most row_tokens tokens. `one_per_row`:
    each sequence alone in its row (prompt not shared), for models whose layers carry state that
    no attention mask can scope (linear attention, sleuth.system.attention.linear_attention)."""
    validate_groups(groups)
    if row_tokens < 1:
        raise UserError(f"row_tokens must be positive, got {row_tokens}")
    seq_offset: list[int] = []
    total = 0
    for group in groups:
        seq_offset.append(total)
        total += len(group.completions)
    # Parts: (size, group index, forest of the part); then first-fit decreasing into rows.
    parts: list[tuple[int, int, list[_Node]]] = []
    for g, group in enumerate(groups):
        seqs = [sequence(group, c) for c in group.completions]
        forest = prefix_forest(seqs)
        split = [(len(seq), [i]) for i, seq in enumerate(seqs)] if one_per_row else \
            _split_group(_paths(forest, len(seqs)), row_tokens)
        for size, members in split:
            parts.append((size, g, _induced(forest, set(members))))
    parts.sort(key=lambda p: (-p[0], p[1]))
    bins: list[list[tuple[int, int, list[_Node]]]] = []
    fill: list[int] = []
    for part in parts:
        for b, used in enumerate(fill):
            if not one_per_row and used + part[0] <= row_tokens:
                bins[b].append(part)
                fill[b] += part[0]
                break
        else:
            bins.append([part])
            fill.append(part[0])
    rows = [_build_row(groups, [(g, forest) for _, g, forest in in_row], seq_offset, pad_to_multiple, pad_id)
            for in_row in bins]
    seq_lengths = torch.tensor([sum(loss_mask(c)) for group in groups for c in group.completions], dtype=torch.long)
    return PackedBatch(rows=rows, seq_lengths=seq_lengths, n_tokens=sum(fill))


@dataclass
class _RowBuilder:
    ids: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    seg: list[int] = field(default_factory=list)
    scope: list[int] = field(default_factory=list)
    nodes: list[RowNode] = field(default_factory=list)

    def lay_out(self, node: _Node, seqs: list[list[int]], tree: int, parent: int,
                starts: dict[int, int]) -> None:
        """Append node's subtree depth first: its span, its leaf children, its other children."""
        leaves = [c for c in node.children if not c.children]
        inner = [c for c in node.children if c.children]
        index = self._span(node, seqs, tree, parent, starts)
        for child in leaves:
            self._span(child, seqs, tree, index, starts)
        for child in inner:
            self.lay_out(child, seqs, tree, index, starts)
        start = self.nodes[index].start  # the node's keys are seen by its whole subtree
        self.scope[start : start + node.size] = [len(self.ids)] * node.size

    def _span(self, node: _Node, seqs: list[list[int]], tree: int, parent: int, starts: dict[int, int]) -> int:
        start = len(self.ids)
        starts[id(node)] = start
        self.ids.extend(seqs[node.seqs[0]][node.depth : node.end])
        self.pos.extend(range(node.depth, node.end))
        self.seg.extend([tree] * node.size)
        self.scope.extend([start + node.size] * node.size)
        self.nodes.append(RowNode(start, node.size, parent))
        return len(self.nodes) - 1


def _build_row(groups: list[Group], parts: list[tuple[int, list[_Node]]], seq_offset: list[int],
               pad_to_multiple: int, pad_id: int) -> PackedRow:
    b = _RowBuilder()
    predictor: list[int] = []
    targets: list[int] = []
    token_seq: list[int] = []
    engine: list[float] = []
    adv: list[float] = []
    guided: list[bool] = []
    masks: list[tuple[torch.Tensor | None, int]] = []  # per placement: its targets' bitmask rows
    placements: list[Placement] = []
    tree = 0
    for g, forest in parts:
        group = groups[g]
        assert group.advantages is not None
        seqs = [sequence(group, c) for c in group.completions]
        starts: dict[int, int] = {}
        for root in forest:
            b.lay_out(root, seqs, tree, -1, starts)
            tree += 1
        paths = _paths(forest, len(seqs))
        for c, path in enumerate(paths):
            if not path:
                continue
            comp = group.completions[c]
            positions = [starts[id(node)] + k for node in path for k in range(node.size)]
            plen = len(seqs[c]) - len(comp.completion_ids)
            mask = loss_mask(comp)
            picked = [k for k, m in enumerate(mask) if m]
            predictor.extend(positions[plen + k - 1] for k in picked)
            targets.extend(comp.completion_ids[k] for k in picked)
            engine.extend(comp.logprobs[k] for k in picked)
            seq = seq_offset[g] + c
            token_seq.extend([seq] * len(picked))
            guided.extend([comp.guided] * len(picked))
            if comp.token_advantages is None:
                adv.extend([float(group.advantages[c])] * len(picked))
            else:  # per-answer credit (credit.py)
                adv.extend(float(comp.token_advantages[k]) for k in picked)
            bm = comp.token_bitmask
            masks.append((None if bm is None else bm[torch.tensor(picked, dtype=torch.long)], len(picked)))
            placements.append(Placement(seq, g, c, tuple(positions), plen, len(path), len(picked)))
    pad = (-len(b.ids)) % pad_to_multiple
    n = len(b.ids)
    b.ids.extend([pad_id] * pad)
    b.pos.extend([0] * pad)
    b.seg.extend([-1] * pad)
    b.scope.extend(range(n + 1, n + pad + 1))  # padding attends itself only

    def long(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long)

    return PackedRow(
        input_ids=long(b.ids), position_ids=long(b.pos), segment_ids=long(b.seg), scope_end=long(b.scope),
        predictor_index=long(predictor), target_ids=long(targets), token_seq=long(token_seq),
        engine_logprobs=torch.tensor(engine, dtype=torch.float32),
        advantages=torch.tensor(adv, dtype=torch.float32), token_bitmask=_row_bitmask(masks),
        guided=torch.tensor(guided, dtype=torch.bool) if any(guided) else None,
        placements=placements, nodes=b.nodes,
    )


def _row_bitmask(masks: list[tuple[torch.Tensor | None, int]]) -> torch.Tensor | None:
    """The row's [N, W] target bitmask: placements without one allow every token (all bits set)."""
    width = next((m.shape[1] for m, _ in masks if m is not None), None)
    if width is None:
        return None
    return torch.cat([m if m is not None else torch.full((n, width), -1, dtype=torch.int32) for m, n in masks])
