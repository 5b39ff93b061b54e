"""GPU check, training step: a single-GPU Megatron GPTModel training step per gradient mode, with
the plugin's codec forced on (``GiftConfig.exchange.loopback``: encode, decode, FP32 sum, unwhiten, nothing
sent) although the data-parallel group has one rank, so that the plugin's whole on-GPU cost per
step shows against ``--gift-mode off`` (stock Megatron DDP).

The model is the Llama-600M of ``overhead.MODELS`` (``testing.gpt.build_tiny_gpt``: local layer
spec, RoPE, SwiGLU, RMSNorm, no Transformer Engine or apex) in BF16 (``Float16Module``, FP32
gradient buffer as Megatron's ``--bf16`` sets it), Adam through the distributed optimizer,
overlapped gradient reduction, Megatron's default 40M-element buckets. A step is
``zero_grad_buffer`` + ``micro-batches`` forward+backward passes (all but the last under
``no_sync``, as Megatron's schedule does) + ``finish_grad_sync`` + the optimizer step, timed by the
host clock between two device synchronisations. GIFT's refresh steps (statistics summed, factors
built: steps 0, 1, 2, 4, 8, ... then every ``refresh_interval``; the step after one still finishes
its build at ``zero_grad_buffer`` and installs it at its first bucket sync: timed apart too, as
``after_refresh``) are reported apart from the steady steps; ``off-again`` repeats the baseline last, to
show the run's resolution.

Every mode but ``off-again`` then gets three more steady steps looked at closely (``steady_looks``:
host synchronisations, that step's peak memory, a profiler trace of codec/backward overlap, and a
step under ``set_sync_debug_mode("error")``; ``gpu_trace``).

Modes run one after the other in one process (NCCL on CUDA, gloo with the CPU harness in the dry
run, both over a one-rank group); peak device memory is taken per mode after the previous mode's
model, optimizer and caches are freed.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time

import torch
import torch.distributed as dist

from megatron_gift.config import GiftConfig, Mode, Schedule
from megatron_gift_tools.bench import gpu_trace
from megatron_gift_tools.bench.overhead import MODELS

# gift-lagged: GIFT with --gift-schedule lagged, against gift's default (eager on CUDA), so that the first GPU
# run says which schedule to default to (issue 35 item 7; one GPU: the stage streams' waits, no NCCL)
MODES = ("off", "bf16", "euclidean", "gift", "gift-lagged", "off-again")
CLOSE_LOOKS = MODES[:-1]  # modes that get the sync, trace and memory looks at a steady step (not the repeat)
TARGET_PLUGIN_OVER_STEP = 0.02  # target: the plugin's on-GPU work <= 2% of a BF16 step (Euclidean, GIFT)
_600M = MODELS["llama-600m"]
SPECS = {
    # 8 sequences of 2048 tokens per step: the paper's 64-GPU share of a 512-sequence global batch
    "gpu": dict(
        model="llama-600m",
        layers=_600M["layers"],
        hidden=_600M["hidden"],
        heads=_600M["heads"],
        ffn=_600M["ffn"],
        seq=_600M["seq"],
        vocab=50304,
        micro_batch=1,
        microbatches=8,
        steps=16,
        warmup=3,
        bucket_size=None,
    ),
    "dry-run": dict(
        model="tiny",
        layers=2,
        hidden=64,
        heads=4,
        ffn=128,
        seq=32,
        vocab=256,
        micro_batch=2,
        microbatches=2,
        steps=6,  # steps 2..7: GIFT refreshes at 2 and 4, finishes builds at 3 and 5, is steady at 6 and 7
        warmup=2,
        bucket_size=6000,
    ),
}


def gift_config(mode: str) -> GiftConfig | None:
    """The plugin configuration of a mode (None: stock Megatron DDP), the codec forced on."""
    if mode.startswith("off"):
        return None
    if mode == "gift-lagged":
        return GiftConfig.build(mode=Mode.GIFT, loopback=True, schedule=Schedule.LAGGED)
    return GiftConfig.build(mode=Mode(mode), loopback=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build(mode: str, spec: dict):
    """Model (BF16), DDP (stock or the plugin's) and distributed optimizer of one mode."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel
    from megatron_gift.testing.gpt import build_tiny_gpt

    gpt = build_tiny_gpt(
        vocab=spec["vocab"],
        seq=spec["seq"],
        num_layers=spec["layers"],
        hidden_size=spec["hidden"],
        num_attention_heads=spec["heads"],
        ffn_hidden_size=spec["ffn"],
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    model = Float16Module(gpt.config, gpt)
    kwargs = {} if spec["bucket_size"] is None else {"bucket_size": spec["bucket_size"]}
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=True, **kwargs
    )
    cfg = gift_config(mode)
    if cfg is None:
        ddp = DistributedDataParallel(gpt.config, ddp_config, model)
    else:
        ddp = GiftDistributedDataParallel(gpt.config, ddp_config, model, gift_config=cfg)
    opt_config = OptimizerConfig(
        optimizer="adam", lr=1e-4, bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True
    )
    return ddp, get_megatron_optimizer(opt_config, [ddp], use_gloo_process_groups=False)


def refresh_schedule(ddp):
    """``n -> whether step n rebuilds GIFT's factors`` (statistics are folded every step, summed and built on
    these), by the step's index: between two steps ``ddp.step`` is the one just done, not the next."""
    gift = any(g.candidate for g in getattr(ddp, "gift_params", {}).values())
    return ddp.is_refresh_step if gift else lambda n: False


def steady_from(refresh, step: int, count: int = 1) -> int:
    """The first step from ``step`` on that starts ``count`` steady steps: neither they nor the step before them
    refreshes (the step after a refresh still finishes its build at ``zero_grad_buffer``)."""
    while any(refresh(n) for n in range(step - 1, step + count)):
        step += 1
    return step


def batches_for(spec: dict, device: torch.device):
    """``step -> its micro-batches`` (``spec``'s token batches, on ``device``)."""
    from megatron_gift.testing.gpt import random_tokens

    return lambda step: [
        random_tokens(step, i, batch=spec["micro_batch"], vocab=spec["vocab"], seq=spec["seq"]).to(device)
        for i in range(spec["microbatches"])
    ]


def _step(ddp, opt, batches: list[torch.Tensor], scope=contextlib.nullcontext) -> tuple[torch.Tensor, bool]:
    """One training step over ``batches`` (micro-batches); returns the last micro-batch's loss and
    whether it rebuilt GIFT's factors (a refresh step). ``scope()`` wraps the forward and backward passes
    and ``finish_grad_sync`` (not the optimizer step); the last backward runs under the profiler mark
    ``gpu_trace.BACKWARD``."""
    from megatron_gift.testing.gpt import lm_loss

    ddp.zero_grad_buffer()
    refresh = refresh_schedule(ddp)(getattr(ddp, "step", -1))  # the step just opened (stock DDP counts none)
    opt.zero_grad()
    with scope():
        with ddp.no_sync():
            for tokens in batches[:-1]:
                (lm_loss(ddp, tokens) / len(batches)).backward()
        loss = lm_loss(ddp, batches[-1]) / len(batches)
        with torch.profiler.record_function(gpu_trace.BACKWARD):
            loss.backward()
        ddp.finish_grad_sync()
    ok, _, _ = opt.step()
    if not ok:
        raise RuntimeError("the optimizer skipped a step (non-finite gradients)")
    return loss.detach(), refresh


def run_mode(mode: str, spec: dict, device: torch.device) -> dict:
    """Train ``warmup + steps`` steps in one mode; step times, losses and peak device memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    ddp, opt = _build(mode, spec)
    static = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    gift = getattr(ddp, "gift_params", {})
    coded = sum(p.numel() for p, g in gift.items() if g.mode is not Mode.OFF)
    times, refresh, after, losses = [], [], [], []
    previous = False  # whether the step before was a refresh: the next one finishes its factor build
    batches_of = batches_for(spec, device)
    for step in range(spec["warmup"] + spec["steps"]):
        batches = batches_of(step)
        _sync(device)
        t0 = time.perf_counter()
        loss, was_refresh = _step(ddp, opt, batches)
        _sync(device)
        elapsed = time.perf_counter() - t0
        if step >= spec["warmup"]:
            (refresh if was_refresh else after if previous else times).append(elapsed)
        previous = was_refresh
        losses.append(float(loss) * spec["microbatches"])
    cuda = device.type == "cuda"
    out = dict(
        mode=mode,
        gift_config=None if gift_config(mode) is None else str(gift_config(mode)),
        coded_elements=coded,
        step_s=statistics.median(times),
        step_times_s=times,
        refresh_step_s=statistics.median(refresh) if refresh else None,
        refresh_step_times_s=refresh,
        after_refresh_step_s=statistics.median(after) if after else None,
        after_refresh_step_times_s=after,
        losses=losses,
        static_memory_bytes=static,
        peak_memory_bytes=torch.cuda.max_memory_allocated(device) if cuda else None,
        peak_reserved_bytes=torch.cuda.max_memory_reserved(device) if cuda else None,
    )
    if mode in CLOSE_LOOKS:  # after the peaks above: these reset them
        out.update(steady_looks(ddp, opt, batches_of, spec["warmup"] + spec["steps"], device))
    del ddp, opt
    return out


def steady_looks(ddp, opt, batches_of, step: int, device: torch.device) -> dict:
    """Three more steady steps from ``step`` on (refresh steps and the step after each skipped): host synchronisations
    (``gpu_trace.sync_probe``) with the step's peak memory over what was allocated before it, a profiler trace
    (``gpu_trace.profiled``: codec work overlapping the backward), and last ``set_sync_debug_mode("error")``
    (``gpu_trace.sync_error``: it aborts)."""
    peak, looked = {}, []
    refresh = refresh_schedule(ddp)  # by index (the first H200 run's looks read ddp.step and traced a refresh step)

    def steady(scope=contextlib.nullcontext):
        nonlocal step
        start = steady_from(refresh, step)
        for skipped in range(step, start):
            _step(ddp, opt, batches_of(skipped))
        step = start
        looked.append(step)
        if device.type == "cuda":
            _sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        _step(ddp, opt, batches_of(step), scope)
        step += 1
        if device.type == "cuda":
            _sync(device)
            peak.setdefault("bytes", torch.cuda.max_memory_allocated(device) - before)

    syncs = gpu_trace.sync_probe(steady, device)
    trace = gpu_trace.profiled(steady, device)
    return dict(
        looked_steps=looked,
        steady_syncs=syncs,
        steady_step_peak_extra_bytes=peak.get("bytes"),
        overlap=trace,
        sync_error=gpu_trace.sync_error(steady, device),
    )


@contextlib.contextmanager
def one_rank_group(device: torch.device):
    """A one-rank process group and Megatron's parallel state (TP = PP = DP = 1): NCCL on CUDA;
    gloo under the CPU harness on the CPU (the dry run). No gloo groups on CUDA: none is needed."""
    from megatron.core import parallel_state

    harness = contextlib.nullcontext()
    if device.type == "cpu":
        from megatron_gift.megatron import cpu_harness

        harness = cpu_harness.install()
    else:
        torch.cuda.set_device(device.index or 0)  # a bare "cuda" device has no index to set
    with harness:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )
        try:
            parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
            yield
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def summarize(results: list[dict], spec: dict) -> dict:
    """Each mode against ``--gift-mode off`` (the median over both off runs' steady steps)."""
    by_mode = {r["mode"]: r for r in results}
    off = statistics.median(by_mode["off"]["step_times_s"] + by_mode["off-again"]["step_times_s"])
    tokens = spec["micro_batch"] * spec["microbatches"] * spec["seq"]
    modes = {}
    for mode, r in by_mode.items():
        plugin = r["step_s"] - off
        syncs, trace = r.get("steady_syncs"), r.get("overlap")
        modes[mode] = dict(
            step_s=r["step_s"],
            over_off=r["step_s"] / off,
            plugin_s=plugin,
            plugin_over_step=plugin / off,
            plugin_s_per_element=plugin / r["coded_elements"] if r["coded_elements"] else None,
            refresh_step_s=r["refresh_step_s"],
            after_refresh_step_s=r["after_refresh_step_s"],
            peak_memory_bytes=r["peak_memory_bytes"],
            peak_memory_over_off=(
                r["peak_memory_bytes"] / by_mode["off"]["peak_memory_bytes"] if r["peak_memory_bytes"] else None
            ),
            steady_step_peak_extra_bytes=r.get("steady_step_peak_extra_bytes"),
            plugin_syncs=sum(syncs["plugin"].values()) if syncs else None,
            sync_error_raised=(r.get("sync_error") or {}).get("raised"),
            codec_overlap_share=trace["share_overlapping_backward"] if trace else None,
        )
    return dict(
        tokens_per_step=tokens,
        off_step_s=off,
        compute_s_per_token=off / tokens,
        resolution=by_mode["off-again"]["step_s"] / by_mode["off"]["step_s"] - 1,
        eager_over_lagged=by_mode["gift"]["step_s"] / by_mode["gift-lagged"]["step_s"],
        modes=modes,
    )


def targets(summary: dict) -> dict:
    """The plugin's on-GPU work per step over a BF16 ``off`` step, Euclidean and GIFT, against 2%; and
    zero host synchronisations of the plugin in a steady step (every plugin mode)."""
    over = {m: summary["modes"][m]["plugin_over_step"] for m in (Mode.EUCLIDEAN.value, Mode.GIFT.value)}
    syncs = {m: summary["modes"][m]["plugin_syncs"] for m in CLOSE_LOOKS if not m.startswith("off")}
    return dict(
        plugin_over_step=over,
        target=TARGET_PLUGIN_OVER_STEP,
        met=all(v <= TARGET_PLUGIN_OVER_STEP for v in over.values()),
        steady_plugin_syncs=syncs,
        syncs_met=all(v == 0 for v in syncs.values()),
    )


SCHEMA = {
    "results": "one record per mode: mode, gift_config, coded_elements (gradient elements the plugin quantizes), "
    "step_s (median steady step), step_times_s, refresh_step_s / refresh_step_times_s (GIFT refresh steps), "
    "after_refresh_step_s / after_refresh_step_times_s (the step after each refresh: it finishes the factor build at "
    "zero_grad_buffer; apart from the steady steps since the first H200 run, where 4 of gift's 13 'steady' steps "
    "were these), "
    "losses (every step's last micro-batch), static_memory_bytes (after building), peak_memory_bytes, "
    "peak_reserved_bytes; modes but off-again add three steady steps after the timed ones (looked_steps: their "
    "indices, past refreshes and the step after each): steady_syncs "
    "(gpu_trace.sync_probe: the plugin's host synchronisations by file:line, others' count) with "
    "steady_step_peak_extra_bytes (that step's peak over what was allocated before it), overlap (gpu_trace.overlap of "
    "a profiled step: codec kernels, their seconds, the share overlapping the last backward's compute-stream kernels "
    "and its window), sync_error (set_sync_debug_mode('error'): raised, error, plugin_frame; None on the CPU)",
    "summary": "tokens_per_step, off_step_s (median over both off runs), compute_s_per_token (off_step_s / tokens), "
    "resolution (off-again / off - 1), eager_over_lagged (gift's step, eager on CUDA, over gift-lagged's), "
    "modes: {mode: step_s, over_off, plugin_s (step_s - off_step_s), "
    "plugin_over_step, plugin_s_per_element (plugin_s / coded_elements), refresh_step_s, after_refresh_step_s, "
    "peak_memory_bytes, "
    "peak_memory_over_off, steady_step_peak_extra_bytes, plugin_syncs, sync_error_raised, codec_overlap_share}",
}


def run(spec: dict, device: torch.device) -> dict:
    """The training-step part of the GPU check: ``{schema, spec, results, summary, targets}``."""
    with one_rank_group(device):
        results = [run_mode(mode, spec, device) for mode in MODES]
    summary = summarize(results, spec)
    return dict(schema=SCHEMA, spec=spec, modes=list(MODES), results=results, summary=summary, targets=targets(summary))


def format_table(doc: dict) -> str:
    """Markdown: step time, the plugin's share and peak memory per mode."""
    s = doc["summary"]
    lines = [
        f"{s['tokens_per_step']} tokens per step; resolution (off-again vs off): {100 * s['resolution']:+.2f}%",
        "",
        "| mode | step ms | plugin ms | plugin / off step | refresh step ms | after-refresh step ms | peak GiB | "
        "steady step peak GiB | plugin syncs | codec overlapping backward |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    gib = lambda b: f"{b / 2**30:.2f}" if b else "-"  # noqa: E731
    for mode, m in s["modes"].items():
        refresh = f"{1e3 * m['refresh_step_s']:.1f}" if m["refresh_step_s"] else "-"
        after = f"{1e3 * m['after_refresh_step_s']:.1f}" if m.get("after_refresh_step_s") else "-"
        share = f"{100 * m['plugin_over_step']:.2f}%"
        overlap = "-" if m["codec_overlap_share"] is None else f"{100 * m['codec_overlap_share']:.0f}%"
        syncs = "-" if m["plugin_syncs"] is None else str(m["plugin_syncs"])
        lines.append(
            f"| {mode} | {1e3 * m['step_s']:.1f} | {1e3 * m['plugin_s']:.2f} | {share} | {refresh} | {after} | "
            f"{gib(m['peak_memory_bytes'])} | {gib(m['steady_step_peak_extra_bytes'])} | {syncs} | {overlap} |"
        )
    return "\n".join(lines) + "\n"
