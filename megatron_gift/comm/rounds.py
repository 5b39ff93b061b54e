"""Sub-buckets: a bucket whose message buffers exceed the stated bound (``--gift-inflight-mb``)
reduced in rounds, each a reduction of its own with a region of the arena, one after another.

A round must take a piece of *every* shard (a contiguous sub-range of the bucket would send all
its bytes to one or two owners at a time), and a row of a parameter stays whole inside a round,
except where the bucket's own shard boundary cuts it, which a layout handles inside one reduction
(``RowPiece``: the cut row's projections exchanged). Both hold when each shard is cut into
``rounds`` pieces at row boundaries (or in padding between parameters) and the shards alternate
their order: even shards give round ``k`` their ``k``-th piece from the start, odd ones from the
end. Shard ``j``'s last piece and shard ``j + 1``'s first, the two halves of a cut row, then fall
in the same round (round ``rounds - 1`` after an even ``j``, round 0 after an odd one), adjacent as
they are in the bucket. A round is a ``BucketLayout`` over the same bucket whose shards are those
pieces (``bounds``, unequal) and whose segments are the parameters' rows inside them: every
reduction runs on it unchanged, writing the own shard's pieces, or every piece for an all-reduce,
where the whole bucket's reduction would. Scaling groups never cross a row, so a round's groups
are the bucket's: the same codes and sums, other than a transform's product taken over other rows.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .layout import BucketLayout, Segment, wire_bytes


@dataclass(frozen=True)
class Round:
    """One sub-bucket: ``layout`` (its shards the pieces, its segments the rows inside them) and
    ``origin``, per segment of it the index of its parameter's segment in the bucket's layout."""

    layout: BucketLayout
    origin: tuple[int, ...]

    def per_segment(self, values) -> list:
        """``values`` given per segment of the bucket's layout, for this round's segments."""
        return [values[i] for i in self.origin]

    def feedback(self, error_feedback, bucket: BucketLayout) -> RoundFeedback:
        """The round's view of the bucket's error-feedback residual (indexed by ``bucket``'s coded sequence)."""
        return RoundFeedback(error_feedback, self, bucket)


class RoundFeedback:
    """A round's error feedback: the bucket's residual (``numerics.ErrorFeedback``, kept, committed and
    checkpointed whole), each range of the round's coded sequence mapped to where its segment's values
    lie in the bucket's. A reduction asks for one segment's range at a time (``feedback``)."""

    def __init__(self, error_feedback, part: Round, bucket: BucketLayout):
        layout, self.inner = part.layout, error_feedback

        def build():  # per coded segment of the round: its range there, and where its values start in the bucket's
            segs = [(layout.seg_at[i], layout.segments[i], part.origin[i]) for i in layout.coded_segments]
            return (
                [at for at, _, _ in segs],
                [at + s.rows * s.cols for at, s, _ in segs],
                [bucket.seg_at[o] + s.start - bucket.segments[o].start for _, s, o in segs],
            )

        self.starts, self.ends, self.bases = layout.cached(("round-feedback",), build)

    def feedback(self, lo: int, n: int):
        """``ErrorFeedback.feedback`` of the round's coded ``[lo, lo + n)``, which lies in one segment."""
        k = bisect.bisect_right(self.starts, lo) - 1
        if k < 0 or lo + n > self.ends[k]:
            raise ValueError(f"coded range [{lo}, {lo + n}) of a round crosses its segments")
        return self.inner.feedback(self.bases[k] + lo - self.starts[k], n)


def _inside(segments: list[Segment], starts: list[int], lo: int, hi: int):
    """``(index, a, b)`` of each segment's non-empty part ``[a, b)`` inside bucket ``[lo, hi)``, in order."""
    for i in range(max(0, bisect.bisect_right(starts, lo) - 1), bisect.bisect_left(starts, hi)):
        a, b = max(segments[i].start, lo), min(segments[i].end, hi)
        if a < b:
            yield i, a, b


def _cut(segments: list[Segment], starts: list[int], lo: int, hi: int, target: int) -> int:
    """A point of ``(lo, hi)`` where a round may end inside shard ``[lo, hi)``, near ``target``: the
    row boundary at or below it of the parameter holding it (padding: ``target`` itself), else the
    next one above; ``hi`` where there is none (the shard lies inside one row)."""
    i = bisect.bisect_right(starts, target) - 1
    if i < 0 or target >= segments[i].end:
        return target
    s = segments[i]
    down = s.start + (target - s.start) // s.cols * s.cols
    return down if down > lo else min(hi, down + s.cols)


def _targets(layout: BucketLayout, starts: list[int], lo: int, hi: int, rounds: int) -> list[int]:
    """Where shard ``[lo, hi)`` would end its first ``rounds - 1`` pieces for equal shares of its message
    bytes (each parameter's elements weighted by their bytes on the wire; by elements where it has none)."""
    runs = []  # (a, b, bytes per element) of the parameters inside the shard
    for i, a, b in _inside(layout.segments, starts, lo, hi):
        s = layout.segments[i]
        n = s.rows * s.cols
        runs.append((a, b, wire_bytes(s.mode, s.rows, s.cols, layout.codec, layout.plain_dtypes[0].itemsize) / n))
    total = sum((b - a) * w for a, b, w in runs)
    if not total:
        return [lo + (hi - lo) * k // rounds for k in range(1, rounds)]
    out, done, runs = [], 0.0, iter(runs)
    a, b, w = next(runs)
    for k in range(1, rounds):
        share = total * k / rounds
        while done + (b - a) * w < share and (after := next(runs, None)) is not None:
            done += (b - a) * w
            a, b, w = after
        out.append(min(b - 1, a + int((share - done) / w)))
    return out


def split(layout: BucketLayout, rounds: int) -> list[Round] | None:
    """``layout``'s bucket in ``rounds`` sub-buckets, each about an equal share of every shard's message
    bytes (module doc), or None where a row would be cut across rounds (a shard inside one row)."""
    segs, starts = layout.segments, [s.start for s in layout.segments]
    pieces = []  # per shard: its rounds + 1 cut points, lo first, hi last
    for lo, hi in layout.bounds:
        cuts = [lo]
        for target in _targets(layout, starts, lo, hi, rounds):
            cuts.append(max(cuts[-1], _cut(segs, starts, lo, hi, target)))
        pieces.append([*cuts, hi])
    out = []
    for k in range(rounds):
        bounds = []
        for j, cuts in enumerate(pieces):
            p = k if j % 2 == 0 else rounds - 1 - k
            bounds.append((cuts[p], cuts[p + 1]))
        spans: list[list[int]] = []  # [start, end, origin], adjacent pieces of one segment merged
        for i, lo, hi in (part for a, b in bounds for part in _inside(segs, starts, a, b)):
            if spans and spans[-1][2] == i and spans[-1][1] == lo:
                spans[-1][1] = hi
            else:
                spans.append([lo, hi, i])
        round_segs = []
        for lo, hi, i in spans:
            s = segs[i]
            if (lo - s.start) % s.cols or (hi - s.start) % s.cols:
                return None  # a row of ``s`` split between two rounds
            round_segs.append(Segment(lo, (hi - lo) // s.cols, s.cols, s.mode, s.name))
        sub = BucketLayout(
            layout.numel, layout.num_shards, round_segs, layout.codec, layout.plain_dtypes[0], bounds=bounds
        )
        out.append(Round(sub, tuple(i for _, _, i in spans)))
    return out


def plan(layout: BucketLayout, footprint, need: int, nbytes: int) -> tuple[list[Round] | None, int | None]:
    """The fewest rounds (a few tries) whose reductions' footprints (``footprint(round)``, the bucket's
    ``need``) are at most ``nbytes / 2`` each, one exchange in flight while the next is encoded, else at
    most ``nbytes``; with the largest footprint. ``(None, None)``: the bucket cannot be split (``split``);
    ``(None, footprint)``: its rounds of whole rows stay above ``nbytes``."""
    count, worst = 1, need
    for _ in range(4):
        count = max(count + 1, -(-count * worst // (nbytes // 2)))
        rounds = split(layout, count)
        if rounds is None:
            return None, None
        worst = max(footprint(r) for r in rounds)
        if worst <= nbytes // 2:
            break
    return (rounds if worst <= nbytes else None), worst
