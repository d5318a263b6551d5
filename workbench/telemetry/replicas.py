"""Silent corruption caught: data-parallel replicas compare a digest of their parameters (Megatron's check).

Replicas of a layout hold the same weights by construction (the same seed, averaged gradients, the same update),
so a parameter whose bytes differ between them is a flipped bit, a non-deterministic kernel or a bug in a
synchronisation, and would otherwise go on training unnoticed. The measures are here: `parameter_digests` hashes
each parameter a rank holds (its local shard under tensor parallel), `first_divergence` is the pure comparison
and `ReplicaDivergence` names the rank and the first parameter that differs. Which ranks must hold the same
bytes is the engine's to say: `workbench.engine.replicas.check_replicas(trainer)` gathers the digests over them.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
import torch
from torch import nn

from workbench.telemetry.memory import local_tensor

Digests = list[tuple[str, str]]
"""(parameter name, hex digest of this rank's bytes of it), in the module's order."""


class ReplicaDivergence(RuntimeError):
    """Data-parallel replicas hold different bytes for a parameter that they must hold alike."""

    def __init__(self, divergence: Divergence) -> None:
        self.divergence = divergence
        super().__init__(str(divergence))


@dataclass(frozen=True)
class Divergence:
    ranks: tuple[int, ...]
    """The ranks whose bytes differ from the reference (the digest most replicas hold; with a tie, the lowest
    rank's: with two replicas, rank 0's)."""
    parameter: str
    """The first parameter, in the module's order, where they differ."""
    reference: tuple[int, ...]
    """The ranks that hold the reference bytes."""

    def __str__(self) -> str:
        who = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else "ranks " + ",".join(map(str, self.ranks))
        ref = ",".join(map(str, self.reference))
        return (f"replica check: {who} {'holds' if len(self.ranks) == 1 else 'hold'} different bytes for "
                f"{self.parameter!r} than its data-parallel replicas (rank{'s' if len(self.reference) > 1 else ''} "
                f"{ref}): silent corruption or a broken gradient sync; the first differing parameter is named")


def parameter_digests(modules: Iterable[nn.Module], skip: Iterable[torch.Tensor] = ()) -> Digests:
    """A digest of each parameter's bytes on this rank (its local shard for a DTensor), `skip` left out."""
    skipped = {id(p) for p in skip}
    out: Digests = []
    for i, module in enumerate(modules):
        for name, p in module.named_parameters():
            if id(p) in skipped:
                continue
            data = local_tensor(p).detach().contiguous().cpu()
            digest = hashlib.blake2b(data.view(torch.uint8).reshape(-1).numpy().tobytes(), digest_size=16)
            name = name.removeprefix("module.")  # DDP's wrapper: the model's own names
            out.append((f"{i}:{name}" if i else name, digest.hexdigest()))
    return out


def first_divergence(digests: Mapping[int, Sequence[tuple[str, str]]]) -> Divergence | None:
    """Where the replicas' digests (by rank) first disagree, or None when they agree everywhere (pure)."""
    ranks = sorted(digests)
    if len(ranks) < 2:
        return None
    names = {r: [name for name, _ in digests[r]] for r in ranks}
    longest = max(len(n) for n in names.values())
    for i in range(longest):
        held = {r: tuple(digests[r][i]) if i < len(digests[r]) else ("(missing)", "") for r in ranks}
        if len(set(held.values())) == 1:
            continue
        counts = Counter(held.values())
        top = max(counts.values())
        reference = next(held[r] for r in ranks if counts[held[r]] == top)
        odd = tuple(r for r in ranks if held[r] != reference)
        return Divergence(odd, reference[0], tuple(r for r in ranks if held[r] == reference))
    return None
