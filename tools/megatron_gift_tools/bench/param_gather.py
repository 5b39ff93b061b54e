"""``megatron-gift bench param-gather``: the distributed optimizer's parameter all-gather as coded
changes (``--gift-param-gather delta``), on real deltas of a CPU training run.

A small Llama-style Megatron GPTModel (BF16 parameters, FP32 main parameters, Adam with weight
decay 0.1 and gradient clipping 1, distributed optimizer) trains on the text corpus on gloo
ranks, three runs per learning rate:

* ``stock``: Megatron's BF16 gather. After every step each rank's shard of every bucket holds
  ``new = bf16(main)``; the candidate codecs run on those real changes next to it (open loop):
  ``recon = bf16(recon + decode(encode(new - recon)))`` per codec, started from the first gather,
  exactly the arithmetic of the delta gather: ``int8-step-32`` (the runtime's ``comm.param_delta``:
  int8 in units of the weight's half step or a per-32 power-of-two scale), ``int8-pow2-32`` (int8
  with one power-of-two scale per 32, MXINT8-like) and ``e4m3-fp32-128`` (E4M3 codes, one FP32
  scale per 1x128 block: the gradient codec, ``numerics.fp8``);
* ``delta``: the runtime's delta gather, same seed (closed loop: the forward sees the
  reconstructed weights);
* ``stock-seed2``: stock with another seed (initialization and data), for the seed-to-seed spread.

Per step and codec: the fraction of weights bit-identical to ``bf16(main)``, the largest
``|recon - bf16(main)|`` relative to the element's bound ``h`` (half the quantization step of the
element: the codec's unit over 2 for int8, half the E4M3 spacing at the element times ``s_b`` for
E4M3; the final rounding to BF16 can double it, so <= 2 means within the bound); the error
relative to the step's change ``||recon - new|| / ||new - prev||``; bytes per element on the wire
(payload plus scales; the runtime's bytes from its ledger against Megatron's BF16 ring
all-gather, ``(p-1)`` shards of 2 bytes per element); every replica's ``param_data``
bit-identical (delta run); the loss curves. A zero of either sign counts as identical.

The codec's cost per bucket (``kernels``): the fused kernels (``kernels.delta``; on CUDA, or on
the CPU in Triton's interpreter in a subprocess) launched on buckets of two shard sizes and two
group sizes, each launch recorded with its ``TRAFFIC`` bytes against the pass's essential bytes
(encode: reads ``new`` and ``prev``, writes the message; decode: reads every message and every
row's base, writes every row and ``prev``), per element of the bucket; and the PyTorch path's op
count per bucket (the same at every size up to ``param_delta.CHUNK`` elements a chunk).

``megatron-gift bench param-gather [--quick] [--json PATH] [--ranks N] [--steps N]``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

import torch

CODECS = ("int8-step-32", "int8-pow2-32", "e4m3-fp32-128")  # the first is the runtime's
RUNS = (("stock", 0, "bf16"), ("delta", 0, "delta"), ("stock-seed2", 1, "bf16"))  # name, seed offset, gather


def _roundtrip(codec: str, new: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(bf16(prev + decode(encode(new - prev))), h per element, wire bytes)`` of one shard."""
    from megatron_gift.comm import param_delta
    from megatron_gift.numerics import fp8

    if codec == "int8-step-32":
        msg = torch.empty(param_delta.message_bytes(new.numel()), dtype=torch.uint8).view(1, -1)
        param_delta.encode(new, prev, msg.view(-1))
        recon = prev.clone().view(1, -1)
        param_delta.decode_into(msg, recon)
        return recon.view(-1), param_delta.half_steps(msg, prev.view(1, -1)).view(-1), msg.numel()
    delta = new.float() - prev.float()
    if codec == "int8-pow2-32":  # one power-of-two scale per block: the smallest with max |delta| <= 127 s
        blocks = torch.nn.functional.pad(delta, (0, -delta.numel() % 32)).view(-1, 32)
        mant, expo = torch.frexp(blocks.abs().amax(dim=1))
        s = torch.exp2((expo + (mant > 127 / 128).to(expo.dtype) - 7).clamp(-126, 127).float())[:, None]
        dec = ((blocks / s).round() * s).view(-1)[: delta.numel()]
        h, nbytes = (s / 2).expand_as(blocks).reshape(-1)[: delta.numel()], blocks.numel() + blocks.shape[0]
    else:
        cfg = fp8.CodecConfig(fp8.FP8Format.E4M3, fp8.Scaling.BLOCK, 128)
        lengths = fp8.group_lengths(1, delta.numel(), cfg)
        enc = fp8.encode_flat(delta, lengths, cfg)
        dec, nbytes = fp8.decode_flat(enc, lengths, cfg), enc.nbytes
        s = torch.repeat_interleave(fp8.scale_values(enc.scales, cfg), lengths)
        _, e = torch.frexp(delta.abs() / s)  # |y| in [2^(e-1), 2^e): E4M3 spacing 2^(e-4), 2^-9 below 2^-6
        h = s * torch.exp2(e.clamp(min=-5).float() - 4) / 2
    return (prev.float() + dec).to(new.dtype), h, nbytes


def _stats(got: torch.Tensor, want: torch.Tensor, h: torch.Tensor, prev: torch.Tensor) -> dict:
    """Bit-identical weights (a zero of either sign counts as the same: IEEE sums ``x + (-x)`` to ``+0``),
    max |got - want| / h, squared error and squared change ``want - prev``."""
    diff = got.double() - want.double()
    same = (got.view(torch.int16) == want.view(torch.int16)) | ((got == 0) & (want == 0))
    return dict(
        numel=want.numel(),
        identical=int(same.sum()),
        max_over_h=float((diff.abs() / h.double()).max()),
        err2=float(diff.square().sum()),
        change2=float((want.double() - prev.double()).square().sum()),
    )


def _merge(parts: list[dict]) -> dict:
    n, same = sum(p["numel"] for p in parts), sum(p["identical"] for p in parts)
    return dict(
        identical_fraction=same / n,
        max_over_h=max(p["max_over_h"] for p in parts),
        err_vs_change=(sum(p["err2"] for p in parts) / sum(p["change2"] for p in parts)) ** 0.5,
    )


def _rank_main(rank: int, world: int, spec: dict) -> list[dict]:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_gift.config import GiftConfig, ParamGather
    from megatron_gift.megatron.ddp import GiftDistributedDataParallel
    from megatron_gift.testing.gpt import build_tiny_gpt, lm_loss
    from megatron_gift.testing.reference import replicas_identical, stock_param_shards
    from megatron_gift_tools.bench.corpus import build_token_corpus

    parallel_state.initialize_model_parallel(1, 1)
    corpus = build_token_corpus(vocab_size=spec["vocab"])
    out = []
    for lr in spec["lrs"]:
        for name, seed_offset, gather in RUNS:
            seed = spec["seed"] + seed_offset
            model = build_tiny_gpt(
                seed=seed,
                vocab=corpus.vocab_size,
                seq=spec["seq"],
                bf16=True,
                params_dtype=torch.bfloat16,
                **spec["model"],
            )
            ddp_config = DistributedDataParallelConfig(
                use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=spec["bucket_size"]
            )
            ddp = GiftDistributedDataParallel(
                model.config, ddp_config, model, gift_config=GiftConfig.build(param_gather=ParamGather(gather))
            )
            opt = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam", lr=lr, weight_decay=0.1, bf16=True, clip_grad=1.0, use_distributed_optimizer=True
                ),
                [ddp],
            )
            batches = corpus.batches(spec["seq"], spec["batch"], seed=1000 * seed + rank)
            buckets = [b for bg in ddp.bucket_groups for b in bg.buckets if b.param_data.dtype == torch.bfloat16]
            sim = None
            steps = []
            for _ in range(spec["steps"]):
                inputs, targets = next(batches)
                ddp.zero_grad_buffer()
                opt.zero_grad()
                if sim is None and name == "stock":  # every replica holds the owners' shards: the first full gather
                    sim = {c: [stock_param_shards(opt)[b].clone() for b in buckets] for c in CODECS}
                prev = [b.param_data.clone() for b in buckets]  # the last reconstruction, every shard
                loss = lm_loss(ddp, torch.cat([inputs, targets[:, -1:]], dim=1))
                loss.backward()
                ddp.finish_grad_sync()
                opt.step()  # gathers (no --overlap-param-gather)
                want = stock_param_shards(opt)
                record = dict(loss=float(loss))
                if name == "delta":
                    parts = []
                    for b, p in zip(buckets, prev):
                        s = b.param_data.numel() // world
                        own = slice(rank * s, (rank + 1) * s)
                        _, h, _ = _roundtrip(CODECS[0], want[b], p[own])  # the message the runtime sent
                        parts.append(_stats(b.param_data[own], want[b], h, p[own]))
                    record["runtime"] = parts
                    record["replicas_identical"] = replicas_identical(buckets)
                elif name == "stock":
                    for codec, recon in sim.items():
                        parts, nbytes = [], 0
                        for i, b in enumerate(buckets):
                            last = recon[i]
                            recon[i], h, n = _roundtrip(codec, want[b], last)
                            parts.append(_stats(recon[i], want[b], h, last))
                            nbytes += n
                        record[codec] = dict(parts=parts, bytes=nbytes, numel=sum(want[b].numel() for b in buckets))
                steps.append(record)
            sent = ddp.param_gather_ledger.as_dict()
            ring_bf16 = (world - 1) * sum(b.param_data.numel() // world * 2 for b in buckets)
            out.append(
                dict(
                    lr=lr,
                    run=name,
                    steps=steps,
                    bytes=sent,
                    ring_bf16_per_step=ring_bf16,
                    buckets=len(buckets),
                    numel=sum(b.param_data.numel() for b in buckets),
                )
            )
    parallel_state.destroy_model_parallel()
    return out


KERNEL_CASES = ((2048 * 8, 2), (2048 * 64, 2), (2048 * 8, 8))  # (shard elements, ranks)


def kernel_rows(cases=KERNEL_CASES) -> list[dict]:
    """Launches and bytes of one bucket's encode (the own shard) and decode (every shard) per case,
    fused and PyTorch (``fused=False``: ops counted), on CUDA or the CPU in Triton's interpreter."""
    from megatron_gift.comm import param_delta
    from megatron_gift.kernels import delta
    from megatron_gift.testing.dispatch import OpCounter
    from megatron_gift.testing.kernel_log import launches_of

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for numel, p in cases:
        gen = torch.Generator().manual_seed(numel + p)
        prev = (0.02 * torch.randn(p, numel, generator=gen)).bfloat16().to(device)
        new = (prev.float() + 1e-4 * torch.randn(p, numel, generator=gen).to(device)).bfloat16()
        m = param_delta.message_bytes(numel)
        msgs = torch.empty(p, m, dtype=torch.uint8, device=device)
        with launches_of(delta) as log:
            param_delta.encode(new[0], prev[0], msgs[0], fused=True)
            param_delta.decode_into(msgs, prev.clone(), prev[0].clone(), 0, fused=True)
        e, nb, n = 2, param_delta.blocks(numel), p * numel
        essential = {
            "_encode_kernel": (2 * e * numel, 33 * nb),
            "_decode_kernel": (p * (m + e * numel), (p + 1) * e * numel),
        }
        with OpCounter() as enc:
            param_delta.encode(new[0], prev[0], msgs[0], fused=False)
        with OpCounter() as dec:
            param_delta.decode_into(msgs, prev.clone(), prev[0].clone(), 0, fused=False)
        row = dict(shard=numel, ranks=p, bucket=n, torch_ops=dict(encode=enc.total, decode=dec.total), kernels={})
        for name, bound in log:
            read, written = delta.TRAFFIC[name](bound)
            want = sum(essential[name])
            entry = row["kernels"].setdefault(name, dict(launches=0, bytes=0, essential=want))
            entry["launches"] += 1
            entry["bytes"] += read + written
        for entry in row["kernels"].values():
            entry["vs_essential"] = entry["bytes"] / entry["essential"]
            entry["bytes_per_bucket_element"] = entry["bytes"] / n
        rows.append(row)
    return rows


def _kernel_report() -> dict:
    """``kernel_rows`` here on CUDA, else in a subprocess with Triton's interpreter on."""
    if torch.cuda.is_available():
        return dict(device=torch.cuda.get_device_name(), rows=kernel_rows())
    code = (
        "import json; from megatron_gift_tools.bench.param_gather import kernel_rows; print(json.dumps(kernel_rows()))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    return dict(device="cpu (Triton interpreter)", rows=json.loads(proc.stdout.strip().splitlines()[-1]))


def format_kernels(report: dict) -> str:
    lines = [
        f"delta codec per bucket ({report['device']}): launches, bytes / essential, bytes per bucket element; "
        "PyTorch path ops (encode / decode)",
        "| shard | ranks | encode: launches, bytes/essential, B/elem | decode: launches, bytes/essential, B/elem | "
        "torch ops |",
        "|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        cells = []
        for name in ("_encode_kernel", "_decode_kernel"):
            k = r["kernels"][name]
            cells.append(f"{k['launches']}, {k['vs_essential']:.3f}, {k['bytes_per_bucket_element']:.3f}")
        lines.append(
            f"| {r['shard']} | {r['ranks']} | {cells[0]} | {cells[1]} | {r['torch_ops']['encode']} / "
            f"{r['torch_ops']['decode']} |"
        )
    return "\n".join(lines)


def run(
    quick: bool = False,
    json_path: str | None = None,
    ranks: int = 2,
    steps: int | None = None,
    lrs: tuple[float, ...] | None = None,
    command: str | None = None,
) -> dict:
    """Train, measure, print a table, write JSON; returns the JSON document."""
    from megatron_gift.testing import run_on_ranks
    from megatron_gift_tools.bench.corpus import build_token_corpus

    spec = dict(
        vocab=2048,
        seq=64,
        batch=2,
        seed=1234,
        bucket_size=40000,
        steps=steps or (20 if quick else 200),
        lrs=list(lrs or ((1e-3,) if quick else (1e-3, 3e-4))),
        model=dict(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=352),
    )
    t0 = time.time()
    build_token_corpus(vocab_size=spec["vocab"])  # once, before the ranks read the cache
    print(
        f"[bench param-gather] {ranks} ranks, {spec['steps']} steps, lr {spec['lrs']} ...", file=sys.stderr, flush=True
    )
    kernel_report = _kernel_report()
    print(format_kernels(kernel_report))
    per_rank = run_on_ranks(_rank_main, ranks, spec, cpu_harness=True, timeout=3600)
    results = summarize(per_rank, ranks)
    doc = dict(
        benchmark="param-gather",
        command=command or "megatron-gift bench param-gather" + (" --quick" if quick else ""),
        machine=dict(platform=platform.platform(), processor=platform.processor(), torch=torch.__version__),
        spec=spec,
        ranks=ranks,
        wall_seconds=round(time.time() - t0, 1),
        results=results,
        kernels=kernel_report,
    )
    print(format_table(results))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


def summarize(per_rank: list[list[dict]], world: int) -> list[dict]:
    """One row per learning rate: both codecs (open loop) and the runtime (closed loop), per step and overall."""
    rows = []
    for k in range(0, len(per_rank[0]), len(RUNS)):
        runs = {per_rank[0][k + j]["run"]: [r[k + j] for r in per_rank] for j in range(len(RUNS))}
        stock, delta = runs["stock"], runs["delta"]
        n = len(stock[0]["steps"])
        row = dict(lr=stock[0]["lr"], steps=n, buckets=stock[0]["buckets"], numel=stock[0]["numel"], codecs={})
        for codec in CODECS:
            per_step = [_merge([p for r in stock for p in r["steps"][t][codec]["parts"]]) for t in range(n)]
            nbytes = sum(r["steps"][0][codec]["bytes"] for r in stock)
            numel = sum(r["steps"][0][codec]["numel"] for r in stock)
            row["codecs"][codec] = _series(per_step, bytes_per_element=nbytes / numel)
        per_step = [_merge([p for r in delta for p in r["steps"][t]["runtime"]]) for t in range(n)]
        sent = delta[0]["bytes"].get("all_gather/int8+scales", 0)
        row["runtime"] = _series(
            per_step,
            bytes_vs_bf16_ring=sent / n / delta[0]["ring_bf16_per_step"],
            replicas_bit_identical=all(r["steps"][t]["replicas_identical"] for r in delta for t in range(n)),
            ledger=delta[0]["bytes"],
        )
        loss = {name: [sum(r["steps"][t]["loss"] for r in rs) / world for t in range(n)] for name, rs in runs.items()}
        tail = slice(n // 2, n)
        gap = lambda a, b: sum(abs(x - y) for x, y in zip(a[tail], b[tail])) / len(a[tail])  # noqa: E731
        row["loss"] = dict(
            curves=loss,
            delta_vs_stock_mean_abs=gap(loss["delta"], loss["stock"]),
            seed2_vs_stock_mean_abs=gap(loss["stock-seed2"], loss["stock"]),
            window=[tail.start + 1, n],
        )
        rows.append(row)
    return rows


def _series(per_step: list[dict], **extra) -> dict:
    fractions = [s["identical_fraction"] for s in per_step]
    return dict(
        identical_fraction_min=min(fractions),
        identical_fraction_mean=sum(fractions) / len(fractions),
        max_over_h=max(s["max_over_h"] for s in per_step),
        err_vs_change_max=max(s["err_vs_change"] for s in per_step),
        per_step=per_step,
        **extra,
    )


def format_table(rows: list[dict]) -> str:
    lines = [
        "| lr | codec | bytes/element | bit-identical to bf16(main): min / mean over steps | max diff / h | "
        "error / change (max over steps) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        for name, c in [*r["codecs"].items(), ("runtime (closed loop)", r["runtime"])]:
            size = f"{c['bytes_per_element']:.4f}" if "bytes_per_element" in c else f"{2 * c['bytes_vs_bf16_ring']:.4f}"
            lines.append(
                f"| {r['lr']:g} | {name} | {size} | {c['identical_fraction_min']:.4%} / "
                f"{c['identical_fraction_mean']:.4%} | {c['max_over_h']:.3f} | {c['err_vs_change_max']:.2e} |"
            )
    for r in rows:
        lines.append(
            f"lr {r['lr']:g}: runtime bytes {r['runtime']['bytes_vs_bf16_ring']:.4f}x BF16's ring all-gather, replicas "
            f"bit-identical: {r['runtime']['replicas_bit_identical']}; loss |delta - stock| "
            f"{r['loss']['delta_vs_stock_mean_abs']:.4f} vs seed-to-seed |stock2 - stock| "
            f"{r['loss']['seed2_vs_stock_mean_abs']:.4f} (mean over steps "
            f"{r['loss']['window'][0]}-{r['loss']['window'][1]})"
        )
    return "\n".join(lines)
