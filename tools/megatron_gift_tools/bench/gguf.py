"""A minimal reader of GGUF model files (llama.cpp's format): metadata and the tensors of the types
SmolLM2's Q4_1 file uses (F32, Q4_1, Q8_0; and F16), dequantized to FP32 with NumPy.

Layout (GGUF v2/v3, little-endian): ``"GGUF"``, version u32, tensor count u64, metadata count u64;
metadata ``key (u64 length + UTF-8), type u32, value``; tensor infos ``name, n_dims u32, dims u64
(fastest first), type u32, offset u64``; data from the next multiple of ``general.alignment``.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
# ggml type -> (elements per block, bytes per block): F32, F16, Q4_1, Q8_0
_BLOCKS = {0: (1, 4), 1: (1, 2), 3: (32, 20), 8: (32, 34)}


class _Reader:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == 8:
            return self.string()
        if kind == 9:
            item, n = self.scalar("<I"), self.scalar("<Q")
            return [self.value(item) for _ in range(n)]
        return self.scalar(_SCALARS[kind])


def _dequantize(kind: int, raw: np.ndarray, n: int) -> np.ndarray:
    """``n`` FP32 values from the bytes ``raw`` of ggml type ``kind`` (ggml-quants.c's reference decoders)."""
    if kind == 0:
        return raw.view("<f4")[:n].copy()
    if kind == 1:
        return raw.view("<f2")[:n].astype(np.float32)
    b = raw.reshape(-1, _BLOCKS[kind][1])
    d = b[:, :2].copy().view("<f2").astype(np.float32)
    if kind == 3:  # Q4_1: d, m (FP16), 16 bytes; value j = d·(low nibble of byte j) + m, value j+16: the high nibble
        qs = b[:, 4:]
        x = d * np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32) + b[:, 2:4].copy().view("<f2").astype(
            np.float32
        )
    else:  # Q8_0: d (FP16), 32 int8; value = d·q
        x = d * b[:, 2:].view(np.int8).astype(np.float32)
    return x.reshape(-1)[:n]


def read_gguf(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(metadata, tensors)`` of a GGUF file, every tensor dequantized to FP32 in PyTorch's shape
    (the file's dims reversed: ``[rows, cols]`` for a weight)."""
    with open(path, "rb") as f:
        data = f.read()
    r = _Reader(memoryview(data))
    if bytes(r.buf[:4]) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    r.pos = 4
    version, n_tensors, n_kv = r.scalar("<I"), r.scalar("<Q"), r.scalar("<Q")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    meta = {}
    for _ in range(n_kv):
        key = r.string()
        meta[key] = r.value(r.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        dims = [r.scalar("<Q") for _ in range(r.scalar("<I"))]
        infos.append((name, dims, r.scalar("<I"), r.scalar("<Q")))
    align = int(meta.get("general.alignment", 32))
    start = -(-r.pos // align) * align
    raw = np.frombuffer(data, dtype=np.uint8)
    tensors = {}
    for name, dims, kind, offset in infos:
        if kind not in _BLOCKS:
            raise ValueError(f"{path}: tensor {name} has ggml type {kind}, which this reader does not decode")
        n = int(np.prod(dims))
        per, size = _BLOCKS[kind]
        nbytes = -(-n // per) * size
        x = _dequantize(kind, raw[start + offset : start + offset + nbytes], n)
        tensors[name] = torch.from_numpy(x).view(*reversed(dims))
    return meta, tensors
