"""Numerics: FP8 codec, K-FAC statistics, whitening, geometry statistics, error feedback.

Pure tensor code: nothing here imports torch.distributed or Megatron.
"""

from .error_feedback import ErrorFeedback
from .fp8 import CodecConfig, CodecStats, Encoded, FP8Format, Scaling, decode, decode_flat, encode, encode_flat, roundtrip
from .geometry import GeometryStats, geometry_stats, shares_ratio
from .kfac import KFACStatistics
from .whitening import DenseCholeskyWhitening, LowRankFactor, LowRankWhitening, approximate_factor

__all__ = [
    "CodecConfig",
    "CodecStats",
    "DenseCholeskyWhitening",
    "Encoded",
    "ErrorFeedback",
    "FP8Format",
    "GeometryStats",
    "KFACStatistics",
    "LowRankFactor",
    "LowRankWhitening",
    "Scaling",
    "approximate_factor",
    "decode",
    "decode_flat",
    "encode",
    "encode_flat",
    "geometry_stats",
    "roundtrip",
    "shares_ratio",
]
