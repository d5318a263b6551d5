"""Which rank sends which piece of which tensor to which rank, when a layout changes: pure arithmetic.

A rank's piece of a tensor is a `Region`: for each dim, the global indices the
local tensor holds, in its own order, as runs [start, stop). A DTensor shard is
one run per dim (two or more on a dim `_StridedShard` splits), a whole tensor
one run of its full extent, an expert-parallel slice one run offset by its ep
rank. Given what every rank holds in the old layout and wants in the new one,
`plan_moves` picks, for every wanted piece, which holder sends which box: the
rank itself where it holds the data (a local copy, no communication), else a
replica chosen by the wanting rank's number (spreading the sends). The plan is
a function of what all ranks hold and want, so every rank computes the same
plan from the same gathered description, and no rank needs another message to
know what to send or to expect.

This is DCP's resharding (ChunkStorageMetadata's offsets and lengths, matched
by overlap), done in memory: the boxes never touch a file.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

Runs = tuple[tuple[int, int], ...]
"""One dim of a region: global index runs [start, stop), in the order the local tensor holds them."""
Region = tuple[Runs, ...]
"""A local tensor's place in the global tensor: one `Runs` per dim."""
Box = tuple[tuple[int, int], ...]
"""(start, length) per dim in a local tensor: a contiguous block of it."""


class Uncovered(ValueError):
    """The pieces held cannot make up a wanted piece exactly (missing, overlapping, or mismatched shapes)."""


@dataclass(frozen=True)
class Move:
    """Copy `src`'s box `src_box` of tensor `key` into `dst`'s box `dst_box` (same shape); src == dst: a local copy."""

    key: Hashable
    src: int
    dst: int
    src_box: Box
    dst_box: Box

    @property
    def numel(self) -> int:
        return _box_numel(self.src_box)


def runs_of(indices: Sequence[int]) -> Runs:
    """Global indices in local order → runs of consecutive ones: [0, 1, 2, 6, 7] → ((0, 3), (6, 8))."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, i + 1])
    return tuple((a, b) for a, b in runs)


def whole(shape: Sequence[int]) -> Region:
    """The region of a tensor held whole."""
    return tuple(((0, n),) if n else () for n in shape)


def region_numel(region: Region) -> int:
    n = 1
    for runs in region:
        n *= sum(b - a for a, b in runs)
    return n


def _box_numel(box: Box) -> int:
    n = 1
    for _, length in box:
        n *= length
    return n


def _dim_overlap(src: Runs, dst: Runs) -> list[tuple[int, int, int]]:
    """(position in src, position in dst, length) of every stretch both runs lists hold, in local order."""
    out = []
    src_pos = 0
    for a0, a1 in src:
        dst_pos = 0
        for b0, b1 in dst:
            lo, hi = max(a0, b0), min(a1, b1)
            if lo < hi:
                out.append((src_pos + lo - a0, dst_pos + lo - b0, hi - lo))
            dst_pos += b1 - b0
        src_pos += a1 - a0
    return out


def overlap_boxes(src: Region, dst: Region) -> list[tuple[Box, Box]]:
    """The boxes of `src`'s local tensor and of `dst`'s that hold the same global elements, pairwise."""
    if len(src) != len(dst):
        raise Uncovered(f"a {len(src)}-dim piece cannot fill a {len(dst)}-dim one")
    per_dim = [_dim_overlap(s, d) for s, d in zip(src, dst)]
    return [(tuple((s, n) for s, _, n in combo), tuple((d, n) for _, d, n in combo))
            for combo in itertools.product(*per_dim)]


def _overlap_numel(a: Region, b: Region) -> int:
    return sum(_box_numel(src) for src, _ in overlap_boxes(a, b))


def plan_moves(held: Sequence[Mapping[Hashable, Region]], wanted: Sequence[Mapping[Hashable, Region]]) -> list[Move]:
    """The moves that give every rank r each region `wanted[r][key]` from the regions `held[rank][key]`.

    Ranks holding the same region of a key are replicas; distinct regions must
    not overlap (shards), and together they must fill every wanted region
    exactly, or `Uncovered` is raised (the caller then takes another path).
    Moves come in a fixed order (by key as given in `wanted`, then rank), the
    same on every rank that computes them.
    """
    keys = list(dict.fromkeys(key for want in wanted for key in want))
    moves: list[Move] = []
    for key in keys:
        regions: dict[Region, list[int]] = {}
        for rank, have in enumerate(held):
            if key in have:
                regions.setdefault(have[key], []).append(rank)
        distinct = list(regions)
        for i, a in enumerate(distinct):
            for b in distinct[i + 1:]:
                if _overlap_numel(a, b):
                    raise Uncovered(f"{key}: two different pieces held overlap")
        for dst, want in enumerate(wanted):
            if key not in want:
                continue
            target, got = want[key], 0
            for region in distinct:
                holders = regions[region]
                src = dst if dst in holders else holders[dst % len(holders)]
                for src_box, dst_box in overlap_boxes(region, target):
                    moves.append(Move(key, src, dst, src_box, dst_box))
                    got += _box_numel(src_box)
            if got != region_numel(target):
                raise Uncovered(f"{key}: rank {dst} wants {region_numel(target)} elements, the pieces held give {got}")
    return moves
