"""What the plugin's GPU kernels cost: memory-bound kernels priced by their launches and HBM traffic.

A GPU stage of ``launches`` kernels that moves ``codec_bytes`` in elementwise passes (cast, sums,
encode, decode) and ``transform_bytes`` in GIFT's whitening passes (``G Q``, ``U T⁻¹``) takes
``launches x launch_s + codec_bytes / codec_bw + transform_bytes / transform_bw``
(``KernelCosts.seconds``: the one place a stage's cost is computed). The bandwidths come from the
cluster's HBM (``from_hbm``: ``hbm_bw x codec_hbm_efficiency``, no measurement) or from a
``bench overhead`` JSON (``from_json``: what the codec and the transform measured on that device).
Each stage's launches and bytes are the execution model's (``stages``) or counted in the code (the
delta codec, ``gather.DeltaKernels``); a launch-and-traffic meter's JSON is meant to supply both per
stage, through ``seconds``, when it lands.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass

from ..numerics.fp8 import CodecConfig
from .cluster import Cluster

FP32_PASS_BYTES = 8.0
"""HBM bytes per element of ``bench overhead``'s encode+decode besides the encoded message (written once, read
once: ``CodecConfig.encoded_bytes``, codes and scales): read 4 (FP32), write 4."""
TRANSFORM_PASS_BYTES = 24.0
"""HBM bytes per element of ``bench overhead``'s low-rank apply + inverse: each reads ``G`` twice (``G Q``, then
``G + (G Q) Wᵀ``) and writes it once, in FP32."""


@dataclass(frozen=True)
class KernelCosts:
    """Bandwidths (B/s) of the plugin's memory-bound kernels, the time per kernel launch, one factor build."""

    codec_bw: float
    transform_bw: float
    launch_s: float
    factor_build_s: float
    source: str

    def seconds(self, launches: int, codec_bytes: float, transform_bytes: float = 0.0) -> float:
        """One GPU stage of ``launches`` kernels moving these bytes."""
        return launches * self.launch_s + codec_bytes / self.codec_bw + transform_bytes / self.transform_bw

    @classmethod
    def from_hbm(cls, c: Cluster) -> "KernelCosts":
        bw = c.hbm_bw * c.codec_hbm_efficiency
        return cls(codec_bw=bw, transform_bw=bw, launch_s=c.launch_s, factor_build_s=c.factor_build_s,
                   source=f"estimate: HBM bytes / ({c.codec_hbm_efficiency:g} x {c.hbm_bw / 1e12:g} TB/s) + "
                   f"{c.launch_s * 1e6:g} us per launch")  # fmt: skip

    @classmethod
    def from_json(cls, path: str, c: Cluster, model: str | None = None) -> "KernelCosts":
        """Bandwidths from a ``bench overhead`` JSON, summed over the layers of ``model`` (all if absent): the
        codec's from its encode+decode time, the transform's from GIFT's layers (fc2), the build likewise."""
        doc = json.load(open(path))
        rows = [s for s in doc["summary"] if s["model"] == model] or doc["summary"]
        encoded = CodecConfig().encoded_bytes
        codec_bytes = sum(FP32_PASS_BYTES * r * k + 2 * encoded(r, k) for r, k in (s["shape"] for s in rows))
        fc2 = [s for s in rows if s["layer"] == "fc2"] or rows
        transform_bytes = sum(TRANSFORM_PASS_BYTES * s["shape"][0] * s["shape"][1] for s in fc2)
        return cls(codec_bw=codec_bytes / sum(s["codec_s"] for s in rows),
                   transform_bw=transform_bytes / sum(s["transform_s"] for s in fc2), launch_s=c.launch_s,
                   factor_build_s=statistics.mean(s["factor_build_s"] for s in fc2),
                   source=f"measured: {path} ({rows[0]['model']}, {doc['results'][0]['device']})")  # fmt: skip
