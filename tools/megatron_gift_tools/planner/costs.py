"""What the plugin's GPU kernels cost: memory-bound kernels priced by their launches and HBM traffic.

A GPU stage of ``launches`` kernels that moves ``codec_bytes`` in elementwise passes (cast, sums,
encode, decode) and ``transform_bytes`` in GIFT's whitening passes (``G Q``, ``U T⁻¹``) takes
``launches x launch_s + codec_bytes / codec_bw + transform_bytes / transform_bw``
(``KernelCosts.seconds``: the one place a stage's cost is computed). The bandwidths come from the
cluster's HBM (``from_hbm``: ``hbm_bw x codec_hbm_efficiency``, no measurement) or from a
``bench overhead`` JSON (``from_json``: what the codec and the transform measured on that device).
Each stage's launches and the bytes it moves beyond its essential bytes are the launch-and-traffic
meter's (``meter``: ``metered.Meter``, the JSON of ``megatron-gift bench launches``); without one a
stage is one launch moving its essential bytes (the lower bound; tests and the CPU validation).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field

from megatron_gift.numerics.fp8 import CodecConfig
from megatron_gift_tools.planner.cluster import Cluster
from megatron_gift_tools.planner.metered import Meter

FP32_PASS_BYTES = 8.0
"""HBM bytes per element of ``bench overhead``'s encode+decode besides the encoded message (written once, read
once: ``CodecConfig.encoded_bytes``, codes and scales): read 4 (FP32), write 4."""
TRANSFORM_PASS_BYTES = 24.0
"""HBM bytes per element of ``bench overhead``'s low-rank apply + inverse: each reads ``G`` twice (``G Q``, then
``G + (G Q) Wᵀ``) and writes it once, in FP32."""


@dataclass(frozen=True)
class KernelCosts:
    """Bandwidths (B/s) of the plugin's memory-bound kernels, the time per kernel launch, one factor build, and
    the meter whose launches and moved bytes each stage takes (None: one launch, the essential bytes)."""

    codec_bw: float
    transform_bw: float
    launch_s: float
    factor_build_s: float
    source: str
    meter: Meter | None = field(default=None, compare=False)

    def seconds(self, launches: float, codec_bytes: float, transform_bytes: float = 0.0) -> float:
        """One GPU stage of ``launches`` kernels moving these bytes."""
        return launches * self.launch_s + codec_bytes / self.codec_bw + transform_bytes / self.transform_bw

    def summary(self) -> dict:
        """What the JSON records: the bandwidths, the launch cost, the sources."""
        return dict(
            codec_bw=self.codec_bw,
            transform_bw=self.transform_bw,
            launch_s=self.launch_s,
            factor_build_s=self.factor_build_s,
            source=self.source,
            meter=None
            if self.meter is None
            else dict(source=self.meter.source, date=self.meter.date, sources_sha256=self.meter.sha256),
        )

    @classmethod
    def from_hbm(cls, c: Cluster, meter: Meter | None = None) -> KernelCosts:
        bw = c.hbm_bw * c.codec_hbm_efficiency
        return cls(
            codec_bw=bw,
            transform_bw=bw,
            launch_s=c.launch_s,
            factor_build_s=c.factor_build_s,
            source=f"HBM bytes / ({c.codec_hbm_efficiency:g} x {c.hbm_bw / 1e12:g} TB/s) + "
            f"{c.launch_s * 1e6:g} us per launch",
            meter=meter,
        )

    @classmethod
    def from_json(cls, path: str, c: Cluster, model: str | None = None, meter: Meter | None = None) -> KernelCosts:
        """Bandwidths from a ``bench overhead`` JSON, summed over the layers of ``model`` (all if absent): the
        codec's from its encode+decode time, the transform's from GIFT's layers (fc2), the build likewise."""
        doc = json.load(open(path))
        rows = [s for s in doc["summary"] if s["model"] == model] or doc["summary"]
        encoded = CodecConfig().encoded_bytes
        codec_bytes = sum(FP32_PASS_BYTES * r * k + 2 * encoded(r, k) for r, k in (s["shape"] for s in rows))
        fc2 = [s for s in rows if s["layer"] == "fc2"] or rows
        transform_bytes = sum(TRANSFORM_PASS_BYTES * s["shape"][0] * s["shape"][1] for s in fc2)
        return cls(
            codec_bw=codec_bytes / sum(s["codec_s"] for s in rows),
            transform_bw=transform_bytes / sum(s["transform_s"] for s in fc2),
            launch_s=c.launch_s,
            factor_build_s=statistics.mean(s["factor_build_s"] for s in fc2),
            source=f"bandwidths measured: {path} ({rows[0]['model']}, {doc['results'][0]['device']}) + "
            f"{c.launch_s * 1e6:g} us per launch",
            meter=meter,
        )
