"""Each GPU stage's launches and bytes as the launch-and-traffic meter counts them in the code
(``megatron-gift bench launches``: ``bench/results/launches-cpu.json``, read at run time).

The planner prices a stage at ``launches x Cluster.launch_s + moved bytes / bandwidth``
(``costs.KernelCosts.seconds``), with ``moved = ratio x essential``: ``essential`` the stage's bytes of
one fused pass in the planner's geometry (``stages``, ``gather``: the meter's definitions, the
bench's module doc), ``ratio`` and ``launches`` from the meter's records of the fused path (what
CUDA runs):

- ``ratio``: the record's moved over essential bytes (its ``bytes_read + bytes_written`` over
  ``essential_read + essential_written``; 1 where the essential bytes are 0). The planner's bucket
  takes the Euclidean records' ratio for its non-GIFT elements' share and the GIFT records' for the
  rest and the whitening's bytes.
- ``launches``: ``fixed + per_param x parameters`` of the bucket. ``per_param``: the 8-parameter
  buckets' launches less the 4-parameter ones', over 4 (``SEGMENT_SCAN``'s size); ``fixed``: the
  record's launches less 4 ``per_param``. A bucket with GIFT parameters takes the GIFT records'
  ``fixed`` and per-parameter launches for those, the Euclidean records' for the others, plus, where
  the JSON has ``gift/2w`` records (the FP4 paths: four GIFT parameters of two widths), their launches
  less the ``gift`` ones' for each width of its GIFT parameters beyond the first (the sum-first
  exchange batches the parameters of one shape: its launches grow with the widths, not the parameters).
- The record: the scanned group size nearest the planner's in ``log p``, then the scanned bucket
  size nearest in ``log N`` (1M to 200M elements: the ratios change by a few percent between
  them; a larger bucket takes the 200M record). The scan's two-level groups have 8 ranks per node
  (fewer below 16): the ratio carries over to other node sizes, the essential bytes are the planner's.
  The two-level exchange in FP32 takes the BF16 records (FP32 is not scanned).
- Delta gather: the ``delta-gather`` records (fused), nearest group size, then bucket size.
- Two-sided GIFT (``--gift-side both``/``auto``: every GIFT parameter of the bucket has an output
  side, ``comm.output_side``): the ``gift+out`` records, chosen as above, give the GIFT elements'
  ratio of every stage and the ``output`` stage's launches and ratio. Their launches less the
  ``gift`` records' at the same group and bucket size are the output side's, for the records' 4
  two-sided parameters: per two-sided parameter (a quarter each) in a stage whose GIFT launches
  grow with the parameters (the 8-parameter records: ``send``, ``intra``, ``decode_all``: the
  whole bucket), fixed in the others (the shard's stages, ``reduce`` and ``finish``, where ``P``'s
  partials run); the ``output`` stage, which has no GIFT counterpart, works on the rank's elements:
  per two-sided parameter on the all-reduce paths (the whole bucket), fixed on the reduce-scatter
  ones (the shard). A meter without ``gift+out`` records for a path (older JSON; the committed one
  has them for every path) prices that path's two-sided buckets as the GIFT ones, with
  ``ONE_PASS`` for the ``output`` stage: a lower bound.

FP4 between nodes (``Scheme.inter_format``): the two-level reduce-scatter rows take the meter's FP4 records
(``two-level/<intra>-nvfp4-rs``: the FP4 exchange, the scan's ``gift`` buckets with the Hadamard rotation and
its ``euclidean`` ones without, of ``[rows, 1536]`` parameters) where the JSON has them; the others (mxfp4, the
all-reduce, an older JSON) the FP8 path's, at the FP4 bytes.

Stage names map to the meter's: flat ``send``, ``reduce`` (reduce-scatter), ``gather`` (all-reduce:
decode-sum and re-encode of the shard, fused), ``decode_all``, ``finish`` (the cut rows: launches,
no essential bytes); two-level ``intra``, ``node_sums`` (sums and encode of the held slice, fused),
``reduce``, ``gather_inter``, ``decode_all``, ``finish``; two-sided ``output``; delta ``encode``,
``decode``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

LAUNCHES_JSON = Path(__file__).resolve().parents[3] / "bench" / "results" / "launches-cpu.json"
"""the checkout's meter JSON."""
REGENERATE = "megatron-gift bench launches --json bench/results/launches-cpu.json"
"""the command that rewrites it (``bench.launches.REGENERATE``, the same)."""


@dataclass(frozen=True)
class StageCount:
    """One GPU stage of one bucket: its launches and moved over essential bytes, for the bucket's non-GIFT
    (``ratio``) and GIFT elements (``gift_ratio``)."""

    launches: float
    ratio: float
    gift_ratio: float


ONE_PASS = StageCount(1.0, 1.0, 1.0)
"""without a meter: one fused pass, one launch, its essential bytes (the lower bound)."""
SCAN_PARAMETERS = 4
"""parameters in the meter's buckets (``euclidean``, ``gift``, ``gift+out``; the ``/8`` ones hold twice as many)."""


def _nearest(values, x: float):
    return min(values, key=lambda v: (abs(math.log(v / x)), -v))


def _ratio(s: dict) -> float:
    need = s["essential_read"] + s["essential_written"] if s["essential_read"] is not None else 0
    return (s["bytes_read"] + s["bytes_written"]) / need if need else 1.0


class Meter:
    """The meter's fused records, indexed: ``reduction(...)`` and ``delta(...)`` give a stage's ``StageCount``."""

    def __init__(self, doc: dict, source: str):
        self.source, self.date = source, doc.get("date", "undated")
        self.sha256 = doc.get("sources", {}).get("sha256", "")
        self.segment_size = None
        self._red: dict = {}  # (path, bucket) -> {dp: {elements: {stage: dict}}}
        self._delta: dict = {}  # dp -> {elements: {stage: dict}}
        for r in doc["records"]:
            stages = {s["stage"]: s for s in r.get("stages", [])}
            if r["kind"] == "reduction" and r["kernels"] == "fused":
                key = (r["path"], r["bucket"])
                self._red.setdefault(key, {}).setdefault(r["dp"], {})[r["elements"]] = stages
            elif r["kind"] == "delta-gather" and r.get("kernels") == "fused":
                self._delta.setdefault(r["dp"], {})[r["elements"]] = stages
        need = (("flat-rs", "euclidean"), ("flat-rs", "gift"), ("flat-rs", "euclidean/8"))
        missing = [k for k in need if k not in self._red]
        if missing or not self._delta:
            raise ValueError(
                f"{source} lacks the fused records the planner prices from ({missing or 'delta-gather'}); "
                f"regenerate it: {REGENERATE}"
            )

    @classmethod
    def load(cls, path: str | Path | None = None) -> Meter:
        """The meter JSON at ``path`` (None: the checkout's ``LAUNCHES_JSON``); ValueError if absent or unusable."""
        path = Path(path or LAUNCHES_JSON)
        if not path.exists():
            raise ValueError(
                f"the planner prices each GPU stage from the launch meter's JSON, and {path} does not "
                f"exist: run from a checkout, pass --launches-json PATH, or write it with {REGENERATE}"
            )
        with open(path) as f:
            doc = json.load(f)
        try:
            shown = str(path.resolve().relative_to(LAUNCHES_JSON.parents[2]))
        except ValueError:
            shown = str(path)
        return cls(doc, shown)

    @staticmethod
    def _pick(by_dp: dict, p: int, elements: float) -> tuple[int, int, dict]:
        dp = _nearest(by_dp, p)
        size = _nearest(by_dp[dp], elements)
        return dp, size, by_dp[dp][size]

    def _path(self, path: str) -> str:
        return path.replace("/fp32-", "/bf16-")

    def has(self, path: str) -> bool:
        """Whether the JSON has ``path``'s Euclidean and GIFT records (an FP4 path: the meter's scan has them
        since it meters the FP4 exchange)."""
        path = self._path(path)
        return (path, "euclidean") in self._red and (path, "gift") in self._red

    def _launch_line(self, path: str, bucket: str, stage: str, p: int, elements: float) -> tuple[float, float]:
        """``(fixed, per_param)`` launches of ``stage`` in ``bucket``'s records (module doc)."""
        _, _, rec = self._pick(self._red[(path, bucket)], p, elements)
        eight = self._red.get((path, bucket + "/8"))
        if eight is None:
            return float(rec[stage]["launches"]), 0.0
        dp, size, rec8 = self._pick(eight, p, elements)
        four = self._pick(self._red[(path, bucket)], dp, size)[2]  # the scan has it at the same group and bucket size
        per = (rec8[stage]["launches"] - four[stage]["launches"]) / SCAN_PARAMETERS
        return rec[stage]["launches"] - SCAN_PARAMETERS * per, per

    def reduction(
        self,
        path: str,
        stage: str,
        p: int,
        elements: float,
        parameters: int,
        gift_parameters: int,
        two_sided: bool = False,
        gift_widths: int = 1,
    ) -> StageCount:
        """``stage`` of a bucket of ``elements`` with ``parameters`` (``gift_parameters`` of them GIFT's, of
        ``gift_widths`` widths) at ``p`` ranks on the meter's ``path`` (``flat-rs``, ``two-level/bf16-ar`` ...);
        ``two_sided``: its GIFT parameters have an output side (module doc)."""
        path = self._path(path)
        if two_sided and gift_parameters and (path, "gift+out") in self._red:
            return self._two_sided(path, stage, p, elements, parameters, gift_parameters)
        if stage == "output":  # no gift+out records for this path: the lower bound
            return ONE_PASS
        e_fixed, e_per = self._launch_line(path, "euclidean", stage, p, elements)
        g_fixed, g_per = self._launch_line(path, "gift", stage, p, elements)
        fixed = g_fixed if gift_parameters else e_fixed
        launches = max(0.0, fixed + e_per * (parameters - gift_parameters) + g_per * gift_parameters)
        if gift_parameters and gift_widths > 1 and (path, "gift/2w") in self._red:
            dp, size, two = self._pick(self._red[(path, "gift/2w")], p, elements)
            one = self._pick(self._red[(path, "gift")], dp, size)[2]  # the same group and bucket size
            launches += (two[stage]["launches"] - one[stage]["launches"]) * (gift_widths - 1)
        ratio = _ratio(self._pick(self._red[(path, "euclidean")], p, elements)[2][stage])
        gift_ratio = _ratio(self._pick(self._red[(path, "gift")], p, elements)[2][stage])
        return StageCount(launches, ratio, gift_ratio)

    def _two_sided(
        self, path: str, stage: str, p: int, elements: float, parameters: int, gift_parameters: int
    ) -> StageCount:
        """``reduction`` of a bucket whose GIFT parameters are two-sided: the GIFT count plus the output
        side's launches, the ``gift+out`` records' ratio (module doc)."""
        dp, size, out = self._pick(self._red[(path, "gift+out")], p, elements)
        extra = out[stage]["launches"]
        if stage == "output":
            base, whole_bucket = StageCount(0.0, 1.0, 1.0), path.endswith("-ar")
        else:
            base = self.reduction(path, stage, p, elements, parameters, gift_parameters)
            extra -= self._pick(self._red[(path, "gift")], dp, size)[2][stage]["launches"]  # the same group and size
            whole_bucket = self._launch_line(path, "gift", stage, p, elements)[1] > 0
        extra *= gift_parameters / SCAN_PARAMETERS if whole_bucket else 1.0
        gift_ratio = _ratio(out[stage])
        return StageCount(base.launches + extra, gift_ratio if stage == "output" else base.ratio, gift_ratio)

    def delta(self, stage: str, p: int, elements: float) -> StageCount:
        """The delta gather's ``encode`` or ``decode`` of a bucket of ``elements`` at ``p`` ranks."""
        s = self._pick(self._delta, p, elements)[2][stage]
        return StageCount(float(s["launches"]), _ratio(s), _ratio(s))

    def describe(self) -> str:
        return f"{self.source} ({self.date}, sources {self.sha256[:12]})"
