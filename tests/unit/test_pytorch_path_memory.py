"""The PyTorch path's temporaries (what ``bench memory`` reports per parameter, docs/memory.md): the
peak bytes of the tensors a receive decode-sum, an FP8 or FP4 encode and an FP4 decode create, per element,
held to a count of what each must hold at once (written out in each test), with the block- and
group-level arrays as a small allowance. Bytes do not depend on the CPU."""

import math

import pytest
import torch

from megatron_gift.kernels import reference
from megatron_gift.kernels.reference import reference_decode_sum_unwhiten, reference_whiten_encode
from megatron_gift.numerics.fp4 import MXFP4, NVFP4, decode_fp4, encode_fp4
from megatron_gift.numerics.fp8 import CodecConfig, Encoded, FP8Format, Scaling, decode_flat, encode_flat, group_lengths
from megatron_gift.numerics.profile import _roundtrip_sums
from megatron_gift.testing.dispatch import LiveBytes

N = 1 << 15


def _senders_in_parts(seed: int):
    """E4M3 messages of one row of ``N`` columns from 2, 1 and 4 senders, as a receive's three parts:
    ``(cfg, lengths, payloads, scales)``."""
    cfg = CodecConfig(FP8Format.E4M3, Scaling.BLOCK)
    lengths = group_lengths(1, N, cfg)
    g = torch.Generator().manual_seed(seed)
    encs = [[encode_flat(torch.randn(N, generator=g), lengths, cfg) for _ in range(k)] for k in (2, 1, 4)]
    payloads = [torch.stack([e.payload for e in part]) for part in encs]
    scales = [torch.stack([e.scales for e in part]) for part in encs]
    return cfg, lengths, payloads, scales


def test_decode_sum_holds_one_part_decoded_at_a_time():
    """Three parts of 2, 1 and 4 senders' E4M3 rows: the FP32 sum (4 B per column), at most the largest
    part's FP32 rows (4 x 4 B; one here, in ``DECODE_BLOCKS``' blocks) and, while they are made, either the
    scales' int32 repeat index (4 B per column) or the codes' values in BF16 (4 x 2 B): at most 28 B per
    column whatever the blocks. Catches every part decoded before
    the sum (the three parts' 7 rows live at once: 36 B and more) and a decode holding the codes' FP32
    values beside the repeated scales (4 x 8 B for the last part)."""
    cfg, lengths, payloads, scales = _senders_in_parts(seed=1)
    with LiveBytes(payloads, scales, lengths) as p:
        reference_decode_sum_unwhiten(payloads, scales, 1, N, None, cfg, True, lengths)
    assert p.peak <= (28 + 0.5) * N, f"{p.peak / N:.2f} B per column"


def _senders_in_one_part(seed: int):
    """The 2+1+4 senders' messages of ``_senders_in_parts`` as one part of 7 rows (a flat receive's)."""
    cfg, lengths, payloads, scales = _senders_in_parts(seed)
    return cfg, lengths, [torch.cat(payloads)], [torch.cat(scales)]


def test_decode_sum_in_blocks_of_rows_within_its_budget(monkeypatch):
    """7 senders' rows in one part with a decode budget of one row's values: 7 blocks, one row decoded at
    a time: the FP32 sum, one row's FP32 values and either its int32 repeat index or its codes' BF16
    values, 12 B per column; bit for bit the sum decoded in the default blocks. Catches the budget ignored
    (16 B, ``DECODE_BLOCKS``' two rows: at DP 512 a receiver would decode 128 rows of its shard at once)."""
    cfg, lengths, payloads, scales = _senders_in_one_part(seed=2)
    whole = reference_decode_sum_unwhiten(payloads, scales, 1, N, None, cfg, True, lengths)
    monkeypatch.setattr(reference, "DECODE_VALUES", N)
    with LiveBytes(payloads, scales, lengths) as p:
        blocks = reference_decode_sum_unwhiten(payloads, scales, 1, N, None, cfg, True, lengths)
    assert p.peak <= (12 + 0.5) * N, f"{p.peak / N:.2f} B per column"
    assert torch.equal(blocks.view(torch.int32), whole.view(torch.int32))


def test_decode_sum_of_many_senders_takes_a_quarter_of_their_rows_at_a_time():
    """7 senders' rows in one part at the default budget, which they fit many times over: they still take
    ``DECODE_BLOCKS`` (4) blocks, 2 rows decoded at a time: the FP32 sum, two rows' FP32 values and either
    their int32 repeat index or their codes' BF16 values, 16 B per column; bit for bit the sequential sum
    of the rows decoded one by one. Catches blocks counted from the budget alone (28 B: at 8 ranks a
    receiver decoded its 7 senders' rows of its shard at once, docs/memory.md)."""
    cfg, lengths, payloads, scales = _senders_in_one_part(seed=3)
    assert reference.DECODE_VALUES >= 7 * N and reference.DECODE_BLOCKS == 4
    with LiveBytes(payloads, scales, lengths) as p:
        blocks = reference_decode_sum_unwhiten(payloads, scales, 1, N, None, cfg, True, lengths)
    assert p.peak <= (16 + 0.5) * N, f"{p.peak / N:.2f} B per column"
    rows = [decode_flat(Encoded(p_, s_), lengths, cfg) for p_, s_ in zip(payloads[0], scales[0])]
    want = rows[0].clone()
    for row in rows[1:]:
        want += row
    assert torch.equal(blocks.reshape(-1).view(torch.int32), (want / 7).view(torch.int32))


@pytest.mark.parametrize("fmt", list(FP8Format), ids=lambda f: f.value)
def test_fp8_encode_temporaries(fmt):
    """The flat FP8 encode (the PyTorch path's every sender) holds the per-element scales, divided in
    place into the scaled values (4 B per element), beside their int32 repeat index (4 B) while they
    are made, then beside the Inf mask and the codes (1 B each, E5M2's Inf codes one more): 8 B and the
    per-group arrays. Catches an int64 repeat index (12 B) and a clamped FP32 copy of the scaled
    values (11 B)."""
    cfg = CodecConfig(fmt, Scaling.BLOCK)
    lengths = group_lengths(1, N, cfg)
    x = torch.randn(N, generator=torch.Generator().manual_seed(4))
    with LiveBytes(x, lengths) as p:
        encode_flat(x, lengths, cfg)
    assert p.peak <= 8.25 * N, f"{p.peak / N:.2f} B per element"


@pytest.mark.parametrize("in_place", [False, True], ids=["apart", "in-place"])
def test_error_feedback_encode_stages_the_compensated_values_in_place(in_place):
    """The PyTorch path's encode with error feedback makes ``Ũ = G + e`` where the next residual goes
    and takes ``e' = Ũ - dec(q(Ũ))`` there in place: beside the codes (1 B per element) it holds the
    encode's 8 B, then the decode's repeated scales and their int32 index (4 B each): 9 B and the
    per-group arrays. Catches ``Ũ`` made as a tensor of its own beside the next residual (13 B); with
    ``e'`` the residual ``e`` itself (``ErrorFeedback.feedback``), the same values."""
    cfg = CodecConfig(FP8Format.E4M3, Scaling.BLOCK)
    lengths = group_lengths(1, N, cfg)
    gen = torch.Generator().manual_seed(6)
    g, e = torch.randn(1, N, generator=gen), torch.randn(N, generator=gen) * 0.01
    staged, old = (e, e.clone()) if in_place else (torch.empty(N), e)
    with LiveBytes(g, e, staged, lengths) as p:
        enc = reference_whiten_encode(g, None, cfg, lengths=lengths, feedback=(e, staged))
    assert p.peak <= 9.25 * N, f"{p.peak / N:.2f} B per element"
    # the next residual is Ũ's, by a decode of its own
    e = old
    ref = (g.reshape(-1) + e) - decode_flat(encode_flat(g.reshape(-1) + e, lengths, cfg), lengths, cfg)
    assert torch.equal(staged, ref) and torch.equal(
        enc.payload.reshape(-1), encode_flat(g.reshape(-1) + e, lengths, cfg).payload
    )


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda f: f.name)
def test_fp4_encode_temporaries(fmt):
    """The encode of ``n`` FP32 values holds at most the scaled values (4 B per element), their sign,
    magnitude code and one comparison (1 B each), the packed codes and the per-block arrays (within
    2 B per element at 16 elements a block): 9 B. Catches the scaled values' masked copy (``where``
    beside a ``zeros_like``: 12 B and more) and the magnitudes taken as another copy."""
    x = torch.randn(N, generator=torch.Generator().manual_seed(2))
    with LiveBytes(x) as p:
        encode_fp4(x, fmt)
    assert p.peak <= 9 * N, f"{p.peak / N:.2f} B per element"


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda f: f.name)
def test_fp4_encode_in_place_temporaries(fmt):
    """With ``scratch`` (the stage's own FP32 values, as the two-level path's node sums), the encode
    scales them in place: its largest temporary is the magnitudes for the block maxima (4 B per element),
    then the sign, magnitude code and one comparison (1 B each), and the per-block arrays: 5 B. Catches
    the scaled values made as a new tensor (8 B and more) and a per-element finiteness mask beside the
    magnitudes (``isfinite``: 7 B)."""
    x = torch.randn(N, generator=torch.Generator().manual_seed(5))
    with LiveBytes(x) as p:
        encode_fp4(x, fmt, scratch=True)
    assert p.peak <= 5 * N, f"{p.peak / N:.2f} B per element"


@pytest.mark.parametrize("rows", [1, 4])
def test_fp4_decode_temporaries(rows):
    """NVFP4's decode holds its FP32 output (4 B per element) and the packed bytes' int32 index (2 B), then
    the per-block scales: within 6.25 B per element, also for codes given as rows of a wider buffer (as the
    receive's messages). Catches the codes unpacked first (their bytes and int32 index beside the values:
    9 B), the block and segment scales applied out of place (a new FP32 tensor each: 8 B and more) and the
    rows' codes copied before the decode (6.5 B)."""
    x = torch.randn(N, generator=torch.Generator().manual_seed(3))
    enc = encode_fp4(x, NVFP4)
    width = N // 2 + N // 16 + 64  # the rows' codes and scales inside wider message rows
    msgs = torch.zeros(rows, width, dtype=torch.uint8)
    n = N // rows
    msgs[:, : n // 2] = enc.codes.view(rows, -1)
    msgs[:, width - n // 16 :] = enc.block_scales.view(rows, -1)
    strided = type(enc)(msgs[:, : n // 2], msgs[:, width - n // 16 :], enc.segment_scales)
    with LiveBytes(msgs, enc.segment_scales) as p:
        got = decode_fp4(strided, NVFP4)
    assert p.peak <= 6.25 * N, f"{p.peak / N:.2f} B per element"
    assert torch.equal(got, decode_fp4(enc, NVFP4))


def test_profile_roundtrip_sums_hold_two_fp64_copies():
    """The profile's ``[‖ĝ - g‖², ⟨ĝ, g⟩, ‖ĝ‖²]`` (telemetry's and the policy's, per layer on their steps)
    holds the two FP64 copies (16 B per element) and no FP64 difference or products beside them, and
    equals the sums taken exactly (``math.fsum`` of each FP64 term) to FP64 rounding. Catches the
    difference and its square made as new tensors (32 B per element) and a sum taken in FP32."""
    g = torch.randn(N, generator=torch.Generator().manual_seed(6))
    g_hat = g + 1e-3 * torch.randn(N, generator=torch.Generator().manual_seed(7))
    with LiveBytes(g, g_hat) as p:
        sums = _roundtrip_sums(g, g_hat)
    assert p.peak <= 16 * N + 64, f"{p.peak / N:.2f} B per element"
    a, b = g.double().tolist(), g_hat.double().tolist()
    exact = [
        math.fsum((y - x) ** 2 for x, y in zip(a, b)),
        math.fsum(x * y for x, y in zip(a, b)),
        math.fsum(y * y for y in b),
    ]
    for got, want in zip(sums, exact):
        assert abs(float(got) - want) <= 1e-12 * abs(want)


def test_logging_step_comparison_takes_a_segment_a_quarter_at_a_time(monkeypatch):
    """Telemetry's comparison of a reduced shard with the FP32 reference (``Monitor.after_reduce``) holds
    FP64 copies of both for a quarter of a segment at a time (16 B x N/4) and a few FP64 sums, and
    gives RelL2 and cosine of the exact sums (``math.fsum`` of each FP64 term) to FP64 rounding. Catches
    the whole segment copied at once (16 B per element: at 2 ranks the logging step's peak, 4.81 B/param
    over stock's, docs/memory.md)."""
    from types import SimpleNamespace

    from megatron_gift.comm.layout import Segment
    from megatron_gift.config import Mode
    from megatron_gift.megatron import monitor

    monkeypatch.setattr(monitor.dist, "all_reduce", lambda *a, **k: None)  # one rank: the sums are its own
    gen = torch.Generator().manual_seed(11)
    ref = torch.randn(N, generator=gen)
    grad = ref + 1e-3 * torch.randn(N, generator=gen)
    seg = Segment(0, 4, N // 4, Mode.GIFT, "w")
    bucket = SimpleNamespace(
        layout=SimpleNamespace(shards=[SimpleNamespace(lo=0, hi=N)]),
        grad=grad,
        segments=lambda: [(seg, SimpleNamespace(name="w"))],
    )
    group = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    m = monitor.Monitor.__new__(monitor.Monitor)
    m.reduced = {}
    with LiveBytes(grad, ref) as p:
        m.after_reduce([bucket], group, [ref], average=False)
    assert p.peak <= 16 * N // 4 + 1024, f"{p.peak / N:.2f} B per element"
    x, y = grad.double().tolist(), ref.double().tolist()
    err, ref_sq = math.fsum((a - b) ** 2 for a, b in zip(x, y)), math.fsum(b * b for b in y)
    dot, dec_sq = math.fsum(a * b for a, b in zip(x, y)), math.fsum(a * a for a in x)
    rel, cos = m.reduced["w"]
    assert math.isclose(rel, math.sqrt(err / ref_sq), rel_tol=1e-9)
    assert math.isclose(cos, dot / math.sqrt(dec_sq * ref_sq), rel_tol=1e-12)


@pytest.mark.parametrize("rotation", [False, True], ids=["plain", "hadamard"])
@pytest.mark.parametrize("error_feedback", [False, True], ids=["no-ef", "ef"])
def test_fp4_sender_holds_one_parameter_at_a_time(error_feedback, rotation, monkeypatch):
    """The flat NVFP4 sender (``FP4Reduce``'s send stage) on a bucket of four parameters of ``n`` elements
    (two GIFT, two Euclidean), beside its messages: one parameter's FP32 values (4 B per element) and its
    encode's magnitudes (4 B), or the rotation's two buffers: 8 B per element of one parameter, and with
    error feedback and a rotation (``Ũ`` lies in the residual) the decoded values and the inverse
    rotation's buffer besides the forward one's: 12 B; the block arrays within 1 B. Catches the bucket's
    coded sequence made in FP32 and encoded in one call (16 B per parameter element before the encode's
    temporaries), a parameter's values kept alive into the next one's, the rotation's stages stacked
    into new tensors, and a Euclidean parameter's gradient scaled in place as the encode's scratch."""
    from megatron_gift.comm import fp4_reduce
    from megatron_gift.comm.fp4_reduce import FP4Reduce
    from megatron_gift.comm.layout import BucketLayout, Segment
    from megatron_gift.comm.schedule import StageResult
    from megatron_gift.config import Mode
    from megatron_gift.numerics.error_feedback import ErrorFeedback
    from megatron_gift.numerics.rotation import BlockHadamard
    from tests.dist.test_comm import _transforms
    from tests.unit.test_fp4_launches import _Group

    monkeypatch.setattr(fp4_reduce.dist, "all_to_all_single", lambda *a, **k: None)
    rows, cols = 64, 512
    n = rows * cols
    modes = (Mode.GIFT, Mode.EUCLIDEAN, Mode.GIFT, Mode.EUCLIDEAN)
    segments = [Segment(k * n, rows, cols, m, f"p{k}") for k, m in enumerate(modes)]
    layout = BucketLayout(4 * n, 2, segments, CodecConfig(), torch.float32)
    layout.check_blocks(64, "test")
    flat = torch.randn(4 * n, generator=torch.Generator().manual_seed(8))
    red = FP4Reduce(
        flat,
        layout,
        _Group(2),
        _transforms(segments),
        NVFP4,
        rotation=BlockHadamard(64, 1) if rotation else None,
        error_feedback=ErrorFeedback(layout.n_coded) if error_feedback else None,
    )
    before = flat.clone()
    red._send(StageResult())  # builds the layout's tables
    with LiveBytes() as p:
        sent = red._send(StageResult())
    held = (p.peak - sent.buf.numel()) / n
    assert held <= (13 if error_feedback and rotation else 9), f"{held:.2f} B per element of one parameter"
    assert torch.equal(flat, before)  # the sender's scratch is its own values, never the bucket's
