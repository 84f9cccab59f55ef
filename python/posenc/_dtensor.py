"""Plain tensors beside DTensor inputs: the functions place index tensors and tables given as
plain tensors as ``Replicate()`` on the mesh of the DTensor input, as the modules do
(``posenc.distributed.accept_dtensor_inputs``), instead of DTensor's "mixed torch.Tensor and
DTensor" error. The check is a type-name test, so calls on plain tensors import nothing."""

from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor


def is_dtensor(t: object) -> bool:
    return type(t).__name__ == "DTensor" and type(t).__module__.startswith("torch.distributed")


def place_beside(like: Tensor, *tensors: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
    """``tensors`` unchanged unless ``like`` is a DTensor; then each plain tensor becomes a
    replicated DTensor on ``like``'s mesh (every rank must hold the same values, as for any
    replicated tensor). Importing posenc.distributed also registers the ops' sharding rules."""
    if not is_dtensor(like):
        return tensors
    from posenc.distributed import replicate_like

    return tuple(replicate_like(like, t) for t in tensors)


def is_sharded(t: object) -> bool:
    """Whether t is a DTensor some rank holds only a part of (a placement other than
    Replicate): a value check of its local shard would raise on that rank alone."""
    return is_dtensor(t) and any(not p.is_replicate() for p in t.placements)


def placed_as(out: Tensor, like: Tensor) -> Tensor:
    """A DTensor result of an op that keeps each element where it lies (add_position, RoPE's
    rotation), in the placements of its input ``like``, as torch's pointwise ops keep theirs:
    where the op's rules gathered the input (a split with dropout, a sequence split beside
    replicated positions) they returned the whole tensor replicated, and torch's
    SequenceParallel style, which hands each rank's part on as it is (use_local_output), gave
    each rank the whole tensor as its part. Replicate to Shard takes each rank's part (no
    communication). An input's Partial placements stay the op's."""
    if (not is_dtensor(out) or not is_dtensor(like) or out.placements == like.placements
            or any(pl.is_partial() for pl in like.placements)):
        return out
    return out.redistribute(like.device_mesh, like.placements)
