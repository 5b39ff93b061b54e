"""GPU check, codec bandwidth: the FP8 codec and the fused GIFT kernels at the Llama-600M layer
shapes, as bytes per second next to a device-to-device copy timed in the same run.

For each linear layer's weight gradient ``G [d_out, d_in]`` (``planner.workloads.layer_shapes``) and each
implementation (``fused``: the Triton kernels, where ``overhead.fused_timed``; ``reference``: the
PyTorch path they replace):

===========================  =================================================  ========================================
path                         what runs                                          bytes counted (fewest a pass can move)
===========================  =================================================  ========================================
``encode``                   ``whiten_encode(G, None)``: FP8 codes + 1x128      ``4 n + n + scales``
                             block scales                                       (``n = d_out·d_in``)
``whiten_encode``            ``whiten_encode(G, T)``: ``G T`` (rank 32) and     the same (``T``'s factors are
                             FP8 in one pass                                    ``O(d_in·r)``)
``whiten_encode_groups``     the same with ``lengths`` (each row's 1x128        the same
                             blocks as groups): the bucket sender's call
                             (``encode_bucket`` always passes them): the
                             ``_ROW_GROUPS`` tiling
``decode_sum``               ``decode_sum_unwhiten(.., None)``: 8 peers'        ``8 (m + scales_m) + 4 m``
                             messages of this rank's shard
                             (``m = d_out/8 · d_in``), FP32 sum in rank order
``decode_sum_unwhiten``      the same, then ``T⁻¹``                             the same
===========================  =================================================  ========================================

The four-bit exchange's codec (``comm.fp4_reduce``'s calls, NVFP4 and MXFP4, under ``doc["fp4"]``) adds
``fp4_encode/<format>`` (the layer's FP32 values, one segment, into a message buffer at a one-shard
placement: read ``4n``, write ``n/2 + n/block`` and NVFP4's segment scale) and ``fp4_decode_sum/<format>``
(``RANKS`` senders' messages of this rank's shard, FP32 sum in sender order: read their codes and scales,
write ``4m``) and ``fp4_rotate/hadamard`` (the layer's FP32 values as 64-element blocks, each with a row of
signs, rotated in place: read ``4n``, write ``4n``), ``fused`` (``kernels/fp4.py``) against ``reference``
(``numerics.fp4`` and an index copy; the rotation's gather, ``fwht`` and scatter).

The delta parameter gather's codec (``DELTA_MODULE``), where it is installed, adds
``delta_encode`` (a shard of ``n = d_out·d_in`` BF16 elements against its ``prev``: read ``2n + 2n``,
write the message) and ``delta_decode`` (``RANKS`` shards' messages into ``n`` BF16 parameters: read
the messages and ``2n``, write ``2n``), under ``doc["delta"]``; without the module that part says so and
the rest runs.

Each path is set against ``copy``: an FP32 tensor copy that moves the same number of bytes
(``bytes/8`` elements read and written), timed the same way in the same run; ``copy_large``, a
1 GiB copy (``--dry-run``: 1 MiB), is the machine's copy ceiling. On CUDA the time is
``triton.testing.do_bench``'s median (it flushes the L2 cache before every call, so inputs come
from device memory, as after a backward pass, and the flush hides launch latency); on the CPU
(the dry run) ``overhead.time_call``'s fastest sample. ``host_s``: the wall time per call of 50 calls
back to back with no synchronisation between them, i.e. what the host spends launching one call, where that is
more than the device spends running it (then the device time above is partly the host's too).
"""

from __future__ import annotations

import importlib
import time

import torch

from megatron_gift import kernels
from megatron_gift.numerics.fp4 import FP4_FORMATS, FP4Encoded, decode_fp4, encode_fp4
from megatron_gift.numerics.fp8 import CodecConfig, encode
from megatron_gift.numerics.whitening import LowRankWhitening
from megatron_gift_tools.bench.overhead import RANK, RANKS, fused_timed, synthetic_factor, time_call
from megatron_gift_tools.planner.workloads import layer_shapes

PATHS = ("encode", "whiten_encode", "whiten_encode_groups", "decode_sum", "decode_sum_unwhiten")
HOST_CALLS = 50
# the bucket sender's whitened encode, without and with lengths (the _ROW_GROUPS tiling), at a larger model's shapes
# (issue 35 item 3 asks for the 8B's: gpu_check passes planner.workloads.PRESETS["8b"] on a GPU)
SENDER_PATHS = ("whiten_encode", "whiten_encode_groups")
TARGET_OVER_COPY = 0.7  # target: codec and fused kernels >= 70% of copy bandwidth at the 600M shapes
LARGE_COPY_BYTES = {"gpu": 1 << 30, "dry-run": 1 << 20}
DELTA_MODULE = "megatron_gift.comm.param_delta"
"""The delta gather's codec; this part calls its ``encode(new, prev, out)``, ``decode_into(messages, base)`` and
``message_bytes(numel)``."""
DELTA_PATHS = ("delta_encode", "delta_decode")

SCHEMA = {
    "results": "one record per (layer, path, impl): layer, shape [d_out, d_in], path, impl (fused | reference), "
    "rows x cols processed (decode paths: this rank's shard), peers, bytes (fewest moved), seconds, host_s (the "
    "host's wall time per call of back-to-back calls: its launch cost, where more than the device's), bytes_per_s, "
    "copy_bytes_per_s (a copy of the same bytes, same run), over_copy, over_copy_large",
    "summary": "per (path, impl) over the model's layers: bytes, seconds, host_s (summed; None for the delta codec), "
    "bytes_per_s (sum bytes / sum seconds), "
    "over_copy (against the same-size copies), over_copy_large, s_per_element (seconds per gradient element of G: "
    "encode paths per d_out·d_in, decode paths per shard element)",
    "copy_large": "bytes (read + written), seconds, bytes_per_s of one large FP32 copy: the device's copy ceiling",
    "sender": "None, or the SENDER_PATHS at another model's shapes (the 8B's on a GPU): model, results, summary "
    "as above",
    "targets": "every fused path at >= 70% of the same-size copy's bandwidth (reported, not asserted)",
    "fp4": "the four-bit exchange's codec: results and summary as above for fp4_encode/<format> and "
    "fp4_decode_sum/<format> (rows 1, cols the elements encoded or this rank's shard decoded)",
    "delta": "the delta parameter gather's codec: available, module, and where available results and "
    "summary as above for delta_encode / delta_decode (impl torch; rows 1, cols the elements coded or decoded)",
}


def bench_seconds(fn, device: torch.device) -> tuple[float, str]:
    """Seconds per call of ``fn`` and how they were taken (see the module docstring)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(
            fn, warmup=25, rep=100, return_mode="median"
        ) / 1e3, "triton.testing.do_bench median, L2 flushed"
    return time_call(fn, device)[0], "overhead.time_call fastest sample"


def host_seconds(fn, device: torch.device, calls: int = HOST_CALLS) -> float:
    """Wall seconds per call of ``calls`` back-to-back calls of ``fn``, unsynchronised (module docstring)."""
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls
    sync()
    return host


def copy_record(nbytes: int, device: torch.device) -> dict:
    """A device-to-device FP32 copy moving ``nbytes`` (read + written)."""
    n = max(1, nbytes // 8)
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    seconds, method = bench_seconds(lambda: dst.copy_(src), device)
    return dict(bytes=8 * n, seconds=seconds, bytes_per_s=8 * n / seconds, method=method)


IMPLS = {
    "fused": (kernels.whiten_encode, kernels.decode_sum_unwhiten),
    "reference": (kernels.reference_whiten_encode, kernels.reference_decode_sum_unwhiten),
}


def layer_paths(
    shape: tuple[int, int], device: torch.device, cfg: CodecConfig, impls: list[str], paths: tuple[str, ...] = PATHS
) -> dict:
    """``{(impl, path): (fn, rows, cols, bytes)}`` for one layer's gradient, its inputs made once for every
    implementation in ``impls`` and path in ``paths``."""
    d_out, d_in = shape
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(d_out, d_in, generator=gen).to(device)
    low = LowRankWhitening(synthetic_factor(d_in, RANK), device=device)
    rows = max(1, d_out // RANKS)
    payloads = scales = None
    if any(p.startswith("decode") for p in paths):  # the peers' messages, where a decode path needs them
        peers = [encode(low.apply(torch.randn(rows, d_in, generator=gen).to(device)), cfg) for _ in range(RANKS)]
        payloads = torch.stack([p.payload.reshape(-1) for p in peers])
        scales = torch.stack([p.scales.reshape(-1) for p in peers])
    n, m = d_out * d_in, rows * d_in
    enc_bytes = 5 * n + cfg.scale_bytes(d_out, d_in)
    dec_bytes = RANKS * (m + cfg.scale_bytes(rows, d_in)) + 4 * m
    per_row = [min(cfg.block, d_in - j) for j in range(0, d_in, cfg.block)]
    groups = torch.tensor(per_row * d_out, dtype=torch.int64, device=device)

    def of(we, dsu) -> dict:
        return {
            "encode": (lambda: we(g, None, cfg), d_out, d_in, enc_bytes),
            "whiten_encode": (lambda: we(g, low, cfg), d_out, d_in, enc_bytes),
            "whiten_encode_groups": (lambda: we(g, low, cfg, lengths=groups), d_out, d_in, enc_bytes),
            "decode_sum": (lambda: dsu(payloads, scales, rows, d_in, None, cfg, True), rows, d_in, dec_bytes),
            "decode_sum_unwhiten": (lambda: dsu(payloads, scales, rows, d_in, low, cfg, True), rows, d_in, dec_bytes),
        }

    return {(impl, p): fn for impl in impls for p, fn in of(*IMPLS[impl]).items() if p in paths}


def measure(
    model: dict, device: torch.device, cfg: CodecConfig, large_copy: dict, paths: tuple[str, ...] = PATHS
) -> list[dict]:
    """Time every (layer, path in ``paths``, implementation) of ``model``; returns the result records. A copy of
    each byte count is timed once and shared by the paths that move as many bytes."""
    impls = ["fused", "reference"] if fused_timed(device) else ["reference"]
    records, copies = [], {}
    for layer, shape in layer_shapes(model).items():
        for (impl, path), (fn, rows, cols, nbytes) in layer_paths(shape, device, cfg, impls, paths).items():
            seconds, method = bench_seconds(fn, device)
            host_s = host_seconds(fn, device)
            if nbytes not in copies:
                copies[nbytes] = copy_record(nbytes, device)
            copy = copies[nbytes]
            bw = nbytes / seconds
            records.append(
                dict(
                    layer=layer,
                    shape=list(shape),
                    path=path,
                    impl=impl,
                    rows=rows,
                    cols=cols,
                    peers=RANKS,
                    bytes=nbytes,
                    seconds=seconds,
                    host_s=host_s,
                    bytes_per_s=bw,
                    copy_bytes_per_s=copy["bytes_per_s"],
                    over_copy=bw / copy["bytes_per_s"],
                    over_copy_large=bw / large_copy["bytes_per_s"],
                    method=method,
                )
            )
    return records


def delta_paths(codec, shape: tuple[int, int], device: torch.device) -> dict:
    """``{path: (fn, elements, bytes)}`` of the delta codec at one layer's size (see the module docstring)."""
    n = shape[0] * shape[1]
    gen = torch.Generator().manual_seed(0)
    prev = torch.randn(n, generator=gen).to(device, torch.bfloat16)
    new = (prev.float() + 1e-3 * torch.randn(n, generator=gen).to(device)).to(torch.bfloat16)
    out = torch.empty(codec.message_bytes(n), dtype=torch.uint8, device=device)
    shard = n // RANKS
    messages = torch.zeros(RANKS, codec.message_bytes(shard), dtype=torch.uint8, device=device)
    base = prev[: RANKS * shard].view(RANKS, shard).clone()
    return {
        "delta_encode": (lambda: codec.encode(new, prev, out), n, 4 * n + codec.message_bytes(n)),
        "delta_decode": (
            lambda: codec.decode_into(messages, base),
            RANKS * shard,
            RANKS * codec.message_bytes(shard) + 4 * RANKS * shard,
        ),
    }


FP4_PATHS = tuple(f"{p}/{f}" for f in FP4_FORMATS for p in ("fp4_encode", "fp4_decode_sum")) + ("fp4_rotate/hadamard",)


def fp4_paths(shape: tuple[int, int], device: torch.device, impls: list[str]) -> dict:
    """``{(impl, path): (fn, elements, bytes)}`` of the FP4 codec at one layer's size (module docstring)."""
    from megatron_gift.kernels.placement import Placement
    from megatron_gift.kernels.reference import ordered_sum

    n = shape[0] * shape[1]
    shard = max(1, n // RANKS)
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    out = {}
    for name, fmt in FP4_FORMATS.items():
        n_f, m = n // fmt.block * fmt.block, shard // fmt.block * fmt.block
        seg = 4 if fmt.segment_scale else 0
        codes_at = seg + -(-(m // fmt.block) // 4) * 4  # one message: [segment scale | block scales | codes]
        msg_bytes = codes_at + m // 2
        seg_pos = -(-(n_f // 2 + n_f // fmt.block) // 4)  # the segment scale's FP32 slot after codes and scales
        place = {
            "coded": Placement([n_f // 2], [0], device),
            "groups": Placement([n_f // fmt.block], [n_f // 2], device),
            "segments": Placement([1], [seg_pos], device),
        }
        buf = torch.zeros(4 * seg_pos + 4, dtype=torch.uint8, device=device)
        lengths, ends = (torch.tensor([k], dtype=torch.int64, device=device) for k in (n_f, n_f))
        enc = encode_fp4(torch.randn(m, generator=torch.Generator().manual_seed(1)).to(device), fmt)
        row = torch.zeros(msg_bytes, dtype=torch.uint8, device=device)
        row[codes_at:] = enc.codes
        row[seg : seg + m // fmt.block] = enc.block_scales
        if seg:
            row[:4] = enc.segment_scales.view(torch.uint8)
        msgs = row.expand(RANKS, -1).contiguous()
        m_lengths = torch.tensor([m] * RANKS, dtype=torch.int64, device=device)
        m_ends = torch.tensor([m], dtype=torch.int64, device=device)

        def reference_encode(fmt=fmt, n_f=n_f, place=place, buf=buf, lengths=lengths):
            e = encode_fp4(x[:n_f], fmt, lengths)
            buf.index_put_((place["coded"].index(0, e.codes.numel()),), e.codes)  # as the runtime's reference places
            buf.index_put_((place["groups"].index(0, e.block_scales.numel()),), e.block_scales)
            if fmt.segment_scale:
                buf.view(torch.float32)[-1:].copy_(e.segment_scales)

        def reference_decode(fmt=fmt, m=m, codes_at=codes_at, seg=seg, msgs=msgs, m_lengths=m_lengths):
            e = FP4Encoded(
                msgs[:, codes_at:].reshape(-1),
                msgs[:, seg : seg + m // fmt.block].reshape(-1),
                msgs[:, :4].contiguous().view(torch.float32).reshape(-1) if seg else msgs.new_ones(RANKS).float(),
            )
            return ordered_sum([decode_fp4(e, fmt, m_lengths).view(RANKS, m)])

        if "fused" in impls:
            from megatron_gift.kernels import fp4 as fused_fp4  # imports triton
        calls = {
            "fused": (
                lambda fmt=fmt, n_f=n_f, place=place, buf=buf, ends=ends: fused_fp4.encode_placed(
                    x[:n_f], fmt, ends, buf, place
                ),
                lambda fmt=fmt, m=m, codes_at=codes_at, seg=seg, msgs=msgs, m_ends=m_ends: fused_fp4.decode_sum(
                    msgs, m, fmt, codes_at, seg, 0, m_ends
                ),
            ),
            "reference": (reference_encode, reference_decode),
        }
        for impl in impls:
            encode_fn, decode_fn = calls[impl]
            out[(impl, f"fp4_encode/{name}")] = (encode_fn, n_f, 4 * n_f + n_f // 2 + n_f // fmt.block + seg)
            out[(impl, f"fp4_decode_sum/{name}")] = (decode_fn, m, RANKS * (m // 2 + m // fmt.block + seg) + 4 * m)
    out.update(_rotate_paths(x, device, impls))
    return out


def _rotate_paths(x: torch.Tensor, device: torch.device, impls: list[str]) -> dict:
    """``fp4_rotate/hadamard``: ``x``'s whole 64-blocks rotated in place (``kernels.fp4.rotate_blocks`` and
    its reference), a layer's 16 rows of signs in turn."""
    from megatron_gift.kernels.reference import reference_rotate_blocks
    from megatron_gift.numerics.rotation import BlockHadamard

    n = x.numel() // 64 * 64
    starts = torch.arange(0, n, 64, dtype=torch.int64, device=device)
    rows = torch.arange(n // 64, dtype=torch.int64, device=device) % 16
    signs = BlockHadamard(64, 0).signs(16 * 64, device).view(16, 64)
    calls = {"reference": lambda: reference_rotate_blocks(x, starts, rows, signs)}
    if "fused" in impls:
        from megatron_gift.kernels import fp4 as fused_fp4  # imports triton

        calls["fused"] = lambda: fused_fp4.rotate_blocks(x, starts, rows, signs)
    return {(impl, "fp4_rotate/hadamard"): (calls[impl], n, 8 * n) for impl in impls}


def flat_records(model: dict, device: torch.device, large_copy: dict, paths_of, host: bool) -> list[dict]:
    """Time ``paths_of(shape) -> {(impl, path): (fn, elements, bytes)}`` on every layer of ``model`` against a
    copy of the same bytes: one record per (layer, impl, path), ``rows`` 1; with ``host`` also ``host_s``."""
    records = []
    for layer, shape in layer_shapes(model).items():
        for (impl, path), (fn, elements, nbytes) in paths_of(shape).items():
            seconds, method = bench_seconds(fn, device)
            copy = copy_record(nbytes, device)
            records.append(
                dict(
                    layer=layer,
                    shape=list(shape),
                    path=path,
                    impl=impl,
                    rows=1,
                    cols=elements,
                    peers=RANKS,
                    bytes=nbytes,
                    seconds=seconds,
                    **({"host_s": host_seconds(fn, device)} if host else {}),
                    bytes_per_s=nbytes / seconds,
                    copy_bytes_per_s=copy["bytes_per_s"],
                    over_copy=nbytes / seconds / copy["bytes_per_s"],
                    over_copy_large=nbytes / seconds / large_copy["bytes_per_s"],
                    method=method,
                )
            )
    return records


def measure_fp4(model: dict, device: torch.device, large_copy: dict) -> dict:
    """The FP4 codec's part (module docstring): the fused kernels where ``fused_timed``, and the reference."""
    impls = ["fused", "reference"] if fused_timed(device) else ["reference"]
    records = flat_records(model, device, large_copy, lambda shape: fp4_paths(shape, device, impls), host=True)
    return dict(results=records, summary=summarize(records, large_copy, FP4_PATHS))


def measure_delta(model: dict, device: torch.device, large_copy: dict) -> dict:
    """The delta codec's part: ``available`` False (and why) without ``DELTA_MODULE``."""
    try:
        codec = importlib.import_module(DELTA_MODULE)
    except ImportError as e:
        return dict(available=False, module=DELTA_MODULE, note=f"not installed here: {e}")

    def paths_of(shape):
        return {("torch", path): v for path, v in delta_paths(codec, shape, device).items()}

    records = flat_records(model, device, large_copy, paths_of, host=False)
    return dict(
        available=True, module=DELTA_MODULE, results=records, summary=summarize(records, large_copy, DELTA_PATHS)
    )


def summarize(records: list[dict], large_copy: dict, paths: tuple[str, ...] = PATHS) -> list[dict]:
    """Per (path, impl): totals over the layers (see ``SCHEMA['summary']``)."""
    out = []
    for impl in dict.fromkeys(r["impl"] for r in records):
        for path in paths:
            rows = [r for r in records if r["impl"] == impl and r["path"] == path]
            nbytes, seconds = sum(r["bytes"] for r in rows), sum(r["seconds"] for r in rows)
            copy_s = sum(r["bytes"] / r["copy_bytes_per_s"] for r in rows)
            elements = sum(r["rows"] * r["cols"] for r in rows)
            out.append(
                dict(
                    path=path,
                    impl=impl,
                    bytes=nbytes,
                    seconds=seconds,
                    host_s=sum(r["host_s"] for r in rows) if all("host_s" in r for r in rows) else None,
                    bytes_per_s=nbytes / seconds,
                    over_copy=copy_s / seconds,
                    over_copy_large=nbytes / seconds / large_copy["bytes_per_s"],
                    s_per_element=seconds / elements,
                )
            )
    return out


def targets(summary: list[dict]) -> dict:
    """Each fused path's bandwidth over the same-size copy's, against ``TARGET_OVER_COPY``."""
    fused = {s["path"]: s["over_copy"] for s in summary if s["impl"] == "fused"}
    if not fused:
        return {"fused_timed": False, "note": "no fused kernels on this device: nothing to hold against the target"}
    return dict(
        fused_timed=True,
        over_copy=fused,
        target_over_copy=TARGET_OVER_COPY,
        met=all(v >= TARGET_OVER_COPY for v in fused.values()),
    )


def run(model: dict, device: torch.device, large_copy_bytes: int, sender_model: dict | None = None) -> dict:
    """The codec-bandwidth part of the GPU check: ``{schema, copy_large, results, summary, targets}``, and with
    ``sender_model`` its sender paths at that model's shapes (``SENDER_PATHS``, under ``sender``)."""
    cfg = CodecConfig()
    large = copy_record(large_copy_bytes, device)
    records = measure(model, device, cfg, large)
    summary = summarize(records, large)
    sender = None
    if sender_model is not None:
        sent = measure(sender_model, device, cfg, large, SENDER_PATHS)
        sender = dict(model=sender_model, results=sent, summary=summarize(sent, large, SENDER_PATHS))
    return dict(
        schema=SCHEMA,
        codec=cfg.name,
        block=cfg.block,
        rank=RANK,
        peers=RANKS,
        copy_large=large,
        results=records,
        summary=summary,
        targets=targets(summary),
        delta=measure_delta(model, device, large),
        fp4=measure_fp4(model, device, large),
        sender=sender,
    )


def format_table(doc: dict) -> str:
    """Markdown: GB/s, fraction of copy, device and host time per path and implementation, summed over the layers."""
    lines = [
        "| path | impl | GB/s | / same-size copy | / large copy | device us | host us |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in doc["summary"] + doc["fp4"]["summary"] + doc["delta"].get("summary", []):
        gbs, host = s["bytes_per_s"] / 1e9, s.get("host_s")
        lines.append(
            f"| {s['path']} | {s['impl']} | {gbs:.1f} | {s['over_copy']:.2f} | {s['over_copy_large']:.2f} "
            f"| {s['seconds'] * 1e6:.0f} | {'-' if host is None else f'{host * 1e6:.0f}'} |"
        )
    for s in (doc.get("sender") or {}).get("summary", []):
        lines.append(
            f"| {s['path']} (sender, larger model) | {s['impl']} | {s['bytes_per_s'] / 1e9:.1f} | {s['over_copy']:.2f} "
            f"| {s['over_copy_large']:.2f} | {s['seconds'] * 1e6:.0f} | {s['host_s'] * 1e6:.0f} |"
        )
    if not doc["delta"]["available"]:
        lines.append(f"\ndelta codec: {doc['delta']['note']}")
    lines.append(
        f"\nlarge copy: {doc['copy_large']['bytes_per_s'] / 1e9:.1f} GB/s ({doc['copy_large']['bytes']} bytes moved)"
    )
    return "\n".join(lines) + "\n"
