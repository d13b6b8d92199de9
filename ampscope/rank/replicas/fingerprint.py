"""Exact fingerprints of a rank's parameters, on their device.

A fingerprint is the sum of the parameters' bit patterns read as integers (``int16``
for 2-byte dtypes, ``int32`` for 4- and 8-byte ones), accumulated in ``int64``. The
partial sums never overflow (a chunk holds at most :data:`MAX_BUCKET` elements of at
most 2**31 each), so the result is the same whatever order a kernel adds in:
deterministic on every device, and any change of a single element (one flipped bit
anywhere in it) changes it. A float sum would not do: ``x + y`` can absorb a flipped low
mantissa bit of ``y``, and a NaN's payload is invisible to it.

Two levels, so the check costs the same number of kernels whatever the parameter count:

- :meth:`FingerprintPlan.chunks`, every check: the local parameters of one device and
  view dtype are packed into buckets of at most :data:`MAX_BUCKET` elements; each bucket
  is one ``torch.cat`` (the copy) and one ``sum`` over :data:`CHUNKS_PER_BUCKET` equal
  chunks. Two kernels per bucket, a vector of ``CHUNKS_PER_BUCKET`` int64 values each.
- :meth:`FingerprintPlan.segments`, only once replicas disagree: one sum per named
  parameter (or FSDP1 FlatParameter piece) overlapping a differing chunk, to name it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_BUCKET = 1 << 24
"""Elements packed into one bucket at most: bounds the packed copy (64 MiB for 4-byte
dtypes) and keeps every chunk's int64 sum exact (2**24 * 2**31 < 2**63)."""

CHUNKS_PER_BUCKET = 64
"""Fingerprints per bucket: the collective carries 8 bytes for each."""


@dataclass(frozen=True)
class Piece:
    """A named part of one local parameter tensor: elements ``[offset, offset+numel)`` of
    its flattened view (the whole tensor for ordinary parameters; an original
    parameter's slice of an FSDP1 FlatParameter shard)."""

    name: str
    tensor: torch.Tensor
    offset: int
    numel: int


def dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill one span of its storage, each once, in some order
    of its dimensions (contiguous, ``channels_last``, a transpose): a flat view of that span
    holds exactly its elements."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def bit_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s memory, flattened in storage order, as signed integers of 2 or 4 bytes:
    a view, never a copy (a copy made once would be fingerprinted forever after). A dense
    tensor in another memory format (``channels_last``) is read in its storage order, the
    same on every replica.

    Raises:
        TypeError: a 1-byte dtype (FP8, bool, int8), or memory with gaps or overlaps: not
            supported.
    """
    t = tensor.detach()
    if not t.is_contiguous():
        if not dense(t):
            raise TypeError("cannot fingerprint a parameter whose memory has gaps or overlaps")
        t = torch.as_strided(t, (t.numel(),), (1,), t.storage_offset())
    flat = t.view(-1)
    size = flat.element_size()
    if size == 2:
        return flat.view(torch.int16)
    if size in (4, 8):
        return flat.view(torch.int32)
    raise TypeError(f"cannot fingerprint {tensor.dtype} parameters (1-byte elements)")


def _ints_per_element(tensor: torch.Tensor) -> int:
    return 2 if tensor.element_size() == 8 else 1


@dataclass
class _Bucket:
    parts: list[torch.Tensor]
    """Integer views packed by one ``torch.cat``, the padding's zeros last."""
    spans: list[tuple[int, int, int]]
    """(piece index, start, end) in the packed buffer, in int elements."""
    chunk: int
    """Int elements per chunk."""


class FingerprintPlan:
    """The buckets of a rank's local parameter pieces, built once per ``attach``.

    Args:
        pieces: The pieces to fingerprint, in the same order on every replica (the
            replicas' plans must match: the same model, wrapped the same way).
    """

    def __init__(self, pieces: Sequence[Piece]) -> None:
        self.pieces = list(pieces)
        self._buckets: list[_Bucket] = []
        by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for index, piece in enumerate(self.pieces):
            view = bit_view(piece.tensor)
            by_kind.setdefault((view.device, view.dtype), []).append(index)
        for (device, dtype), indexes in by_kind.items():
            self._pack(indexes, device, dtype)

    def _pack(self, indexes: list[int], device: torch.device, dtype: torch.dtype) -> None:
        parts: list[torch.Tensor] = []
        spans: list[tuple[int, int, int]] = []
        used = 0
        for index in indexes:
            piece = self.pieces[index]
            width = _ints_per_element(piece.tensor)
            start, stop = piece.offset * width, (piece.offset + piece.numel) * width
            view = bit_view(piece.tensor)
            while start < stop:  # a piece larger than a bucket spans several
                take = min(stop - start, MAX_BUCKET - used)
                parts.append(view[start : start + take])
                spans.append((index, used, used + take))
                used += take
                start += take
                if used == MAX_BUCKET:
                    self._close(parts, spans, used, device, dtype)
                    parts, spans, used = [], [], 0
        if used:
            self._close(parts, spans, used, device, dtype)

    def _close(
        self,
        parts: list[torch.Tensor],
        spans: list[tuple[int, int, int]],
        used: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        chunk = math.ceil(used / CHUNKS_PER_BUCKET)
        padding = chunk * CHUNKS_PER_BUCKET - used
        if padding:
            parts = [*parts, torch.zeros(padding, dtype=dtype, device=device)]
        self._buckets.append(_Bucket(parts, spans, chunk))

    @property
    def size(self) -> int:
        """Values :meth:`chunks` returns: ``CHUNKS_PER_BUCKET`` per bucket."""
        return CHUNKS_PER_BUCKET * len(self._buckets)

    @property
    def device(self) -> torch.device:
        """Where :meth:`chunks` puts its vector: the first bucket's device."""
        return self._buckets[0].parts[0].device if self._buckets else torch.device("cpu")

    def chunks(self) -> torch.Tensor:
        """Every chunk's fingerprint, an int64 vector of :attr:`size` on the first
        bucket's device. Two kernels per bucket (the packed copy, the sum) and, with
        several buckets, one concatenation; no sync."""
        sums = [
            torch.cat(bucket.parts).view(CHUNKS_PER_BUCKET, bucket.chunk).sum(1, dtype=torch.int64)
            for bucket in self._buckets
        ]
        if len(sums) == 1:
            return sums[0]
        device = sums[0].device
        return torch.cat([s.to(device) for s in sums])

    def pieces_in(self, chunks: Sequence[int]) -> list[int]:
        """The indexes of the pieces overlapping any of ``chunks`` (positions in
        :meth:`chunks`' vector), in plan order. Host arithmetic only."""
        found: set[int] = set()
        wanted = sorted(set(chunks))
        for position in wanted:
            bucket = self._buckets[position // CHUNKS_PER_BUCKET]
            low = (position % CHUNKS_PER_BUCKET) * bucket.chunk
            high = low + bucket.chunk
            for index, start, end in bucket.spans:
                if start < high and end > low:
                    found.add(index)
        return sorted(found)

    def segments(self, indexes: Sequence[int]) -> torch.Tensor:
        """The fingerprints of the pieces ``indexes`` (an int64 vector, same order), on the
        first bucket's device: one sum per piece. Called only once chunks differ."""
        if not indexes:
            return torch.zeros(0, dtype=torch.int64)
        sums = []
        for index in indexes:
            piece = self.pieces[index]
            width = _ints_per_element(piece.tensor)
            start = piece.offset * width
            view = bit_view(piece.tensor)[start : start + piece.numel * width]
            sums.append(view.sum(dtype=torch.int64).reshape(1))
        device = sums[0].device
        return torch.cat([s.to(device) for s in sums])
