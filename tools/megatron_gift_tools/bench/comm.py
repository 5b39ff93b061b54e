"""``megatron-gift bench comm``: bytes on the wire and fidelity of the reduced gradients in
real multi-rank Megatron-Core runs on CPU (gloo), on the real text corpus.

For each rank count and distributed-optimizer setting, a small Llama-style GPTModel trains a
few steps per mode: ``fp32`` (stock Megatron DDP), ``bf16``, ``euclidean-e4m3`` and
``gift-e4m3`` (all parameters quantized: linear weights in the mode, the rest Euclidean).
Each step's reduced gradients are compared with an FP32 average of the same batches computed
by hand (reference model, all-gather, FP64 sum).

Bytes: the plugin counts what each rank sends (``comm.CommLedger``); stock Megatron's ring
collectives are counted with the same model: reduce-scatter ``(R-1)/R·bytes``, all-reduce twice that.
``bytes_per_step`` = gradient bytes + a factor refresh's bytes (statistics all-reduce, every layer's
factor and transform all-gathered from the ranks that built them) amortized over the default refresh
interval; GIFT refreshes every step here so that its fidelity is measured with the freshest factor
the plugin has (one step old: a refresh is installed at the next step).
``ops/bucket``: the ATen ops the plugin's reduction stages dispatch per quantized bucket in a step
(the most over the ranks), which must not grow with the rank count (docs/gpu-execution.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import platform
import re
import sys
import time

import torch

from megatron_gift.config import GiftConfig, Mode, WhiteningConfig
from megatron_gift.numerics.fp8 import CodecConfig

MODES = ("fp32", "bf16", "euclidean-e4m3", "gift-e4m3")
LINEAR = r"\.linear_(qkv|proj|fc1|fc2)\.weight$"
REFRESH_INTERVAL = WhiteningConfig().refresh_interval
REFRESH_COLLECTIVES = (
    "all_reduce/fp32",
    "reduce_scatter/fp32",
    "all_gather/factors",
)  # statistics (FP32 EMAs), records


def gift_config(mode: str, codec: CodecConfig) -> GiftConfig | None:
    """The plugin configuration of a benchmark mode (None: stock Megatron DDP)."""
    if mode == "fp32":
        return None
    if mode == "bf16":
        return GiftConfig(mode=Mode.BF16, layers=(".*",))
    kind = Mode.GIFT if mode.startswith("gift") else Mode.EUCLIDEAN
    # The factor is refreshed every step here (the freshest the plugin has: one step old); its bytes are
    # amortized over the default interval below.
    return GiftConfig.build(mode=kind, codec=codec, layers=(LINEAR,), euclidean_layers=(".*",), refresh_interval=1)


def megatron_ring_bytes(ddp, dist_opt: bool) -> int:
    """Bytes one rank sends in stock Megatron's ring reduce-scatter / all-reduce of every bucket."""
    total = 0
    for bg in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        n = bg.intra_distributed_optimizer_instance_size if dist_opt else bg.data_parallel_group.size()
        for bucket in bg.buckets:
            nbytes = bucket.grad_data.numel() * bucket.grad_data.element_size()
            total += (1 if dist_opt else 2) * (n - 1) * nbytes // n
    return total


def _count_ops(ddp):
    """Count the ATen ops the plugin's reduction stages dispatch from now on; returns a callable
    giving the count per quantized bucket (None for stock Megatron)."""
    if not hasattr(ddp, "queue"):
        return lambda: None
    from megatron_gift.testing.dispatch import OpCounter

    counter = OpCounter()
    ddp.queue.probe = lambda: counter
    buckets = sum(1 for _ in ddp.gift_buckets())
    return lambda: counter.total / max(buckets, 1)


def _rank_main(rank: int, world: int, spec: dict) -> list[dict]:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel
    from megatron_gift.testing.gpt import build_tiny_gpt, hand_average, lm_loss, reduced_regions
    from megatron_gift_tools.bench.corpus import build_token_corpus

    parallel_state.initialize_model_parallel(1, 1)
    corpus = build_token_corpus(vocab_size=spec["vocab"])
    codec = CodecConfig(spec["format"], spec["scaling"])
    model_args = dict(vocab=corpus.vocab_size, seq=spec["seq"], **spec["model"])
    out = []
    for dist_opt in (True, False):
        for mode in MODES:
            model, ref = build_tiny_gpt(**model_args), build_tiny_gpt(**model_args)
            ddp_config = DistributedDataParallelConfig(
                use_distributed_optimizer=dist_opt, overlap_grad_reduce=True, bucket_size=spec["bucket_size"]
            )
            cfg = gift_config(mode, codec)
            if cfg is None:
                ddp = DistributedDataParallel(model.config, ddp_config, model)
            else:
                ddp = GiftDistributedDataParallel(model.config, ddp_config, model, gift_config=cfg)
            opt = get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=3e-3, use_distributed_optimizer=dist_opt), [ddp]
            )
            batches = corpus.batches(spec["seq"], spec["batch"], seed=rank)
            steps = []
            for _ in range(spec["steps"]):
                inputs, targets = next(batches)
                tokens = torch.cat([inputs, targets[:, -1:]], dim=1)
                ddp.zero_grad_buffer()
                opt.zero_grad()
                ops = _count_ops(ddp)
                lm_loss(ddp, tokens).backward()
                ddp.finish_grad_sync()
                if cfg is None:
                    sent = {
                        "ring/" + ("reduce_scatter" if dist_opt else "all_reduce"): megatron_ring_bytes(ddp, dist_opt)
                    }
                else:
                    sent = ddp.ledger.as_dict()
                expected = hand_average(ref, model, tokens)
                num, den, shards = 0.0, 0.0, []
                for got, want in reduced_regions(ddp, expected, rank, world, dist_opt):
                    num += float((got - want).pow(2).sum())
                    den += float(want.pow(2).sum())
                    shards.append(got.float())
                steps.append(
                    dict(
                        bytes=sent,
                        err2=num,
                        ref2=den,
                        grads=shards,
                        ops_per_bucket=ops(),
                        layers=_layer_errors(ddp, model, expected, rank, world, dist_opt),
                    )
                )
                opt.step()
            params = torch.cat([p.detach().flatten() for p in model.parameters()])
            out.append(dict(mode=mode, distributed_optimizer=dist_opt, steps=steps, params=params))
    parallel_state.destroy_model_parallel()
    return out


def _layer_errors(
    ddp, model, expected: dict, rank: int, world: int, dist_opt: bool
) -> dict[str, tuple[list[float], float]]:
    """Per linear weight (``LINEAR``): the squared error of this rank's reduced region of it in
    ``CHUNKS`` chunks, and its reference's squared norm (``pretrained_steps.noisy_rel_l2`` sums them over ranks)."""
    from megatron_gift_tools.bench.fidelity import chunk_errors

    names = {p: n for n, p in model.named_parameters()}
    out = {}
    for bg in ddp.bucket_groups:
        for bucket in bg.buckets:
            n = bucket.grad_data.numel()
            lo, hi = (rank * n // world, (rank + 1) * n // world) if dist_opt else (0, n)
            for p, (a, b) in bucket.param_to_index.items():
                name = names.get(p, "")
                if not re.search(LINEAR, name) or min(b, hi) <= max(a, lo):
                    continue
                got = bucket.grad_data[max(a, lo) : min(b, hi)].double()
                want = expected[p].flatten()[max(a, lo) - a : min(b, hi) - a].double()
                out[name] = (chunk_errors(got, want), float(want.pow(2).sum()))
    return out


def run(
    quick: bool = True,
    json_path: str | None = None,
    ranks: tuple[int, ...] = (2, 4),
    nodes: tuple[tuple[int, int], ...] = (),
    command: str | None = None,
) -> dict:
    """Run every configuration, print a table, write JSON; returns the JSON document. ``nodes``:
    ``(n, g)`` simulated-node layouts of the link ledger (``links``)."""
    from megatron_gift.testing import run_on_ranks
    from megatron_gift_tools.bench.corpus import build_token_corpus

    spec = dict(
        vocab=2048,
        seq=64 if quick else 128,
        batch=2 if quick else 4,
        steps=2 if quick else 4,
        bucket_size=40000,
        format="e4m3",
        scaling="block",
        model=dict(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=352)
        if quick
        else dict(num_layers=4, hidden_size=192, num_attention_heads=6, ffn_hidden_size=512),
    )
    t0 = time.time()
    build_token_corpus(vocab_size=spec["vocab"])  # once, before the ranks read the cache
    results = []
    for world in ranks:
        print(f"[bench comm] {world} ranks ...", file=sys.stderr, flush=True)
        per_rank = run_on_ranks(_rank_main, world, spec, cpu_harness=True, timeout=1800)
        results.extend(_summarize(per_rank, world))
    links = []
    for n, g in nodes:
        print(f"[bench comm] {n} simulated nodes x {g} ranks ...", file=sys.stderr, flush=True)
        per_rank = run_on_ranks(_links_rank_main, n * g, spec, g, quick, cpu_harness=True, timeout=3600)
        links.extend(_summarize_links(per_rank, n, g))
    doc = dict(
        benchmark="comm",
        command=command or "megatron-gift bench comm" + (" --quick" if quick else ""),
        machine=dict(platform=platform.platform(), processor=platform.processor(), torch=torch.__version__),
        spec=spec,
        bytes_model="plugin: bytes each rank sends (all-to-all: what leaves the rank; ring all-gather: (R-1)*chunk); "
        "stock Megatron: ring reduce-scatter (R-1)/R*bytes, all-reduce 2(R-1)/R*bytes",
        wall_seconds=round(time.time() - t0, 1),
        results=results,
        gift_vs_euclidean=gift_vs_euclidean(results),
        noise="per (step, layer): the standard error of each RelL2 from 16 chunks of every rank's reduced region "
        "(pretrained_steps.noisy_rel_l2); GIFT loses where its RelL2 exceeds Euclidean's by more than 2 combined "
        "standard errors",
        links=links,
        links_model=LINKS_MODEL,
    )
    print(format_table(results))
    print(format_comparison(doc["gift_vs_euclidean"]))
    if links:
        print(format_links(links))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


def _summarize(per_rank: list[list[dict]], world: int) -> list[dict]:
    rows = []
    fp32_bytes = {}
    for k, rec in enumerate(per_rank[0]):
        mode, dist_opt = rec["mode"], rec["distributed_optimizer"]
        runs = [r[k] for r in per_rank]
        n = len(rec["steps"])
        refresh_bytes = sum(v for s in rec["steps"] for k, v in s["bytes"].items() if k in REFRESH_COLLECTIVES) / n
        grad_bytes = sum(v for s in rec["steps"] for k, v in s["bytes"].items() if k not in REFRESH_COLLECTIVES) / n
        bytes_per_step = grad_bytes + refresh_bytes / REFRESH_INTERVAL
        if mode == "fp32":
            fp32_bytes[dist_opt] = bytes_per_step
        err2 = sum(s["err2"] for r in runs for s in r["steps"])
        ref2 = sum(s["ref2"] for r in runs for s in r["steps"])
        identical = all(torch.equal(r["params"], runs[0]["params"]) for r in runs)
        if not dist_opt:  # all-reduce: every rank holds the same reduced gradients
            identical &= all(
                torch.equal(a, b)
                for r in runs
                for s, s0 in zip(r["steps"], runs[0]["steps"])
                for a, b in zip(s["grads"], s0["grads"])
            )
        rows.append(
            dict(
                mode=mode,
                ranks=world,
                distributed_optimizer=dist_opt,
                bytes_per_step=int(bytes_per_step),
                grad_bytes_per_step=int(grad_bytes),
                refresh_bytes=int(refresh_bytes),
                refresh_interval=REFRESH_INTERVAL,
                bytes_ratio_vs_fp32=round(bytes_per_step / fp32_bytes[dist_opt], 4),
                rel_l2_vs_fp32=(err2 / ref2) ** 0.5,
                rel_l2_per_step=[
                    (sum(r["steps"][t]["err2"] for r in runs) / sum(r["steps"][t]["ref2"] for r in runs)) ** 0.5
                    for t in range(n)
                ],
                ranks_bitwise_identical=bool(identical),
                ops_per_bucket=_ops(runs),
                rel_l2_per_layer_step=_per_layer(runs if dist_opt else runs[:1]),
            )
        )
    return rows


def _per_layer(runs: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """Per linear weight, per step: ``(RelL2, its standard error)`` from every rank's chunks (the
    ranks' regions of it: shards with the distributed optimizer; one rank's copy without)."""
    from megatron_gift_tools.bench.fidelity import noisy_rel_l2

    names = sorted({n for r in runs for n in r["steps"][0]["layers"]})  # a rank's shard may hold none of a layer
    parts = lambda name, t: [r["steps"][t]["layers"][name] for r in runs if name in r["steps"][t]["layers"]]  # noqa: E731
    return {
        name: [
            noisy_rel_l2([e for errs, _ in parts(name, t) for e in errs], sum(ref2 for _, ref2 in parts(name, t)))
            for t in range(len(runs[0]["steps"]))
        ]
        for name in names
    }


def gift_vs_euclidean(rows: list[dict]) -> list[dict]:
    """Per rank count and optimizer: every (step, linear layer) of ``gift-e4m3`` against
    ``euclidean-e4m3``, ``loses`` where GIFT's RelL2 exceeds Euclidean's by more than twice their
    combined standard error (the benchmark's noise)."""
    out = []
    by = {(r["ranks"], r["distributed_optimizer"], r["mode"]): r for r in rows}
    for (world, dist_opt, mode), g in by.items():
        e = by.get((world, dist_opt, "euclidean-e4m3"))
        if mode != "gift-e4m3" or e is None:
            continue
        recs = []
        for name, steps in g["rel_l2_per_layer_step"].items():
            for t, ((gr, gs), (er, es)) in enumerate(zip(steps, e["rel_l2_per_layer_step"][name])):
                noise = 2 * math.hypot(gs, es)
                recs.append(
                    dict(step=t, layer=name, gift=gr, euclidean=er, ratio=gr / er, noise=noise, loses=gr - er > noise)
                )
        out.append(
            dict(
                ranks=world,
                distributed_optimizer=dist_opt,
                records=recs,
                losses_beyond_noise=sum(r["loses"] for r in recs),
                worst_ratio=max(r["ratio"] for r in recs),
                worst_ratio_per_step=[max(r["ratio"] for r in recs if r["step"] == t) for t in range(len(steps))],
            )
        )
    return out


def format_comparison(cmp: list[dict]) -> str:
    lines = [
        (
            "| ranks | dist. opt. | (step, layer) records | GIFT above Euclidean beyond noise | "
            "worst GIFT/Euclidean per step |"
        ),
        "|---|---|---|---|---|",
    ]
    for c in cmp:
        lines.append(
            f"| {c['ranks']} | {'on' if c['distributed_optimizer'] else 'off'} | {len(c['records'])} | "
            f"{c['losses_beyond_noise']} | " + ", ".join(f"{x:.3f}" for x in c["worst_ratio_per_step"]) + " |"
        )
    return "\n".join(lines)


def _ops(runs: list[dict]) -> float | None:
    """ATen ops per quantized bucket in the last step, the most over the ranks (None: stock Megatron)."""
    counts = [r["steps"][-1]["ops_per_bucket"] for r in runs]
    return None if counts[0] is None else max(counts)


def format_table(rows: list[dict]) -> str:
    head = (
        "| ranks | dist. opt. | mode | bytes/step/rank | vs FP32 | RelL2 vs FP32 | ranks identical | ops/bucket |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {r['ranks']} | {'on' if r['distributed_optimizer'] else 'off'} | {r['mode']} | {r['bytes_per_step']:,} | "
        f"{r['bytes_ratio_vs_fp32']:.3f} | {r['rel_l2_vs_fp32']:.2e} | "
        f"{'yes' if r['ranks_bitwise_identical'] else 'NO'} | "
        f"{'-' if r['ops_per_bucket'] is None else round(r['ops_per_bucket'])} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


LINKS_MODEL = (
    "per rank, bytes sent to ranks on the same simulated node (intra) and on other nodes (inter) as if each peer's "
    "bytes went to it directly (plugin ledger, gradient exchanges only); NCCL rings over the same links, one ring per "
    "NIC: reduce-scatter inter = (p-1)/p * B/g, intra = (p-1)/p * B - inter, all-reduce twice that (B: bucket bytes); "
    "target = (n-1)/n * S_fp8/g (S_fp8: the buckets' FP8 messages, payload + scales + plain sections), "
    "twice for all-reduce"
)
EXCHANGES = (("flat", "bf16"), ("auto", "bf16"), ("auto", "fp32"), ("auto", "fp8"))


def _links_rank_main(rank: int, world: int, spec: dict, ranks_per_node: int, quick: bool) -> list[dict]:
    """Per (distributed optimizer, mode, exchange): this rank's bytes by link and error vs FP32."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel
    from megatron_gift.testing.gpt import build_tiny_gpt, hand_average, lm_loss, reduced_regions
    from megatron_gift_tools.bench.corpus import build_token_corpus

    parallel_state.initialize_model_parallel(1, 1)
    corpus = build_token_corpus(vocab_size=spec["vocab"])
    codec = CodecConfig(spec["format"], spec["scaling"])
    model_args = dict(vocab=corpus.vocab_size, seq=spec["seq"], **spec["model"])
    out = []
    for dist_opt, mode, (exchange, intra) in itertools.product((True, False), MODES[2:], EXCHANGES):
        model, ref = build_tiny_gpt(**model_args), build_tiny_gpt(**model_args)
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=dist_opt, overlap_grad_reduce=True, bucket_size=spec["bucket_size"]
        )
        cfg = dataclasses.replace(
            gift_config(mode, codec), exchange=exchange, intra_node=intra, ranks_per_node=ranks_per_node
        )
        ddp = GiftDistributedDataParallel(model.config, ddp_config, model, gift_config=cfg)
        batches = corpus.batches(spec["seq"], spec["batch"], seed=rank)
        inputs, targets = next(batches)
        tokens = torch.cat([inputs, targets[:, -1:]], dim=1)
        for _ in range(2):  # the first step builds the layouts' plans: count the second
            ddp.zero_grad_buffer()
            ops = _count_ops(ddp)
            lm_loss(ddp, tokens).backward()
            ddp.finish_grad_sync()
        links = {f"{link}/{dtype}": n for (link, dtype), n in sorted(ddp.ledger.links.items())}
        expected = hand_average(ref, model, tokens)
        regions = list(reduced_regions(ddp, expected, rank, world, dist_opt))
        err2 = sum(float((got - want).pow(2).sum()) for got, want in regions)
        ref2 = sum(float(want.pow(2).sum()) for _, want in regions)
        buckets = [(gb.bucket, gb.layout) for gb in ddp.gift_buckets()]
        bucket_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b, _ in buckets)
        fp8_bytes = sum(p.message_bytes for _, lay in buckets for p in lay.shards)
        out.append(
            dict(
                mode=mode,
                distributed_optimizer=dist_opt,
                exchange=exchange if exchange == "flat" else "two-level",
                intra_node=intra if exchange != "flat" else None,
                links=links,
                err2=err2,
                ref2=ref2,
                bucket_bytes=bucket_bytes,
                fp8_bytes=fp8_bytes,
                ops_per_bucket=ops(),
            )
        )
    parallel_state.destroy_model_parallel()
    return out


def _ring_links(nbytes: int, p: int, g: int, all_reduce: bool) -> dict[str, float]:
    """Per-rank bytes of an NCCL ring reduce-scatter (all-reduce: twice) of ``nbytes`` over ``p`` ranks,
    ``g`` per node, one ring per NIC (see ``LINKS_MODEL``)."""
    total = (2 if all_reduce else 1) * (p - 1) / p * nbytes
    return {"intra": total - total / g, "inter": total / g}


def _summarize_links(per_rank: list[list[dict]], n: int, g: int) -> list[dict]:
    rows = []
    p = n * g
    for k, rec in enumerate(per_rank[0]):
        runs = [r[k] for r in per_rank]
        by_rank = [
            {link: sum(v for key, v in r["links"].items() if key.startswith(link + "/")) for link in ("intra", "inter")}
            for r in runs
        ]
        node_inter = [sum(b["inter"] for b in by_rank[m * g : (m + 1) * g]) for m in range(n)]
        all_reduce = not rec["distributed_optimizer"]
        fp32 = _ring_links(rec["bucket_bytes"], p, g, all_reduce)
        bf16 = _ring_links(rec["bucket_bytes"] // 2, p, g, all_reduce)
        target = (2 if all_reduce else 1) * (n - 1) / n * rec["fp8_bytes"] / g
        inter_fp8 = max(r["links"].get("inter/fp8+scales", 0) for r in runs)
        rows.append(
            dict(
                nodes=n,
                ranks_per_node=g,
                mode=rec["mode"],
                distributed_optimizer=rec["distributed_optimizer"],
                exchange=rec["exchange"],
                intra_node=rec["intra_node"],
                intra_per_rank=max(b["intra"] for b in by_rank),
                inter_per_rank=max(b["inter"] for b in by_rank),
                inter_per_node=max(node_inter),
                inter_fp8_per_rank=inter_fp8,
                target_inter_fp8_per_rank=round(target, 1),
                inter_fp8_vs_target=round(inter_fp8 / target, 4),
                fp32_ring=fp32,
                bf16_ring=bf16,
                inter_vs_bf16_ring=round(max(b["inter"] for b in by_rank) / bf16["inter"], 4),
                rel_l2_vs_fp32=(sum(r["err2"] for r in runs) / sum(r["ref2"] for r in runs)) ** 0.5,
                ops_per_bucket=max(r["ops_per_bucket"] for r in runs),
                links_by_rank=[r["links"] for r in runs],
            )
        )
    return rows


def format_links(rows: list[dict]) -> str:
    head = (
        "| nodes x ranks | dist. opt. | mode | exchange | intra dtype | intra B/rank | inter B/rank | inter B/node | "
        "FP8 inter / target | FP32 ring intra / inter per rank | BF16 ring intra / inter per rank | "
        "inter vs BF16 ring | RelL2 | ops/bucket |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {r['nodes']}x{r['ranks_per_node']} | {'on' if r['distributed_optimizer'] else 'off'} | "
        f"{r['mode']} | {r['exchange']} | "
        f"{r['intra_node'] or '-'} | {r['intra_per_rank']:,} | {r['inter_per_rank']:,} | {r['inter_per_node']:,} | "
        f"{r['inter_fp8_vs_target']:.3f} | {r['fp32_ring']['intra']:,.0f} / {r['fp32_ring']['inter']:,.0f} | "
        f"{r['bf16_ring']['intra']:,.0f} / {r['bf16_ring']['inter']:,.0f} | {r['inter_vs_bf16_ring']:.3f} | "
        f"{r['rel_l2_vs_fp32']:.2e} | {round(r['ops_per_bucket'])} |"
        for r in rows
    ]
    return "\n".join([head, *lines])
