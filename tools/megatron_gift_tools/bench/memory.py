"""``megatron-gift bench memory``: peak extra bytes per parameter over stock Megatron, per mode
and option, at several data-parallel sizes on CPU (gloo ranks, CPU harness).

Each rank builds the same small GPTModel once per configuration and, inside a tracker that
counts every tensor storage created from then on (a ``TorchDispatchMode``: a storage's bytes are
added when an op first returns it and removed when it is freed), wraps it in Megatron's
``DistributedDataParallel`` (``stock``) or ``GiftDistributedDataParallel`` and runs ``steps``
training steps (forward, backward, gradient reduction; distributed optimizer, overlapped
reduction, as in production). Steps 0 and 1 are refresh steps (GIFT's statistics, factor builds
and their all-gather, installed a step later). Per configuration and rank: ``peak`` (the most live
bytes at any moment) and ``held`` (live after the last step closed: persistent state such as
error-feedback residuals, statistics, transforms); with ``steady_step``, the run goes on to at least
that step, until the next one neither refreshes nor installs a refresh (counted by GIFT's own step:
each closing ``zero_grad_buffer`` opens an empty step), and measures its own peak over what was live
when it began (``steady_step`` in the record: GIFT's index of the step measured). Reported per
parameter of the model, minus ``stock``'s, the largest over the ranks:

* ``peak_extra_B_per_param``: what a run needs on top of Megatron's own peak;
* ``held_extra_B_per_param``: the persistent part of it;
* ``transient_extra_B_per_param``: the peak minus the held, i.e. the reduction's buffers
  (send and receive buffers, decoded peers, FP32 copies) and a refresh's builds;
* ``steady_transient_extra_B_per_param``: a steady step's transient (the reduction alone);
* ``arena_B_per_param``: the part of ``held`` that is the reductions' arena (``comm.schedule.Arena``:
  the message buffers in flight, bounded by ``--gift-inflight-mb``; by default two of the largest
  bucket's, at most all of a step's), which would otherwise be transient.

Only tensors count (the allocator's caching, gloo's internal buffers and Python objects do not),
the same way for every configuration. Under Triton's interpreter (the fused configurations) a
garbage collection follows each launch: the interpreter holds a launch's tensor arguments in a
reference cycle, which a CUDA launch does not, and would keep them past their owner's last use.
The model's own parameters exist before the tracker starts; an unmeasured stock run before the
measured ones allocates the process-wide buffers.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time

import torch

from megatron_gift.comm.schedule import Arena
from megatron_gift.config import GiftConfig, InterNodeFormat, Mode
from megatron_gift.testing.dispatch import LiveBytes
from megatron_gift_tools.bench.fidelity import machine

MODEL = dict(hidden_size=128, ffn_hidden_size=512, num_attention_heads=4, num_layers=2)
PRESETS = {
    "default": dict(ranks=(2, 4, 8), steps=2, steady_step=6, model=MODEL),
    "quick": dict(ranks=(2,), steps=1, steady_step=None, model=dict(MODEL, hidden_size=64, ffn_hidden_size=128)),
}
# name -> GiftConfig keyword arguments (None: Megatron's own DistributedDataParallel)
CONFIGS = {
    "stock": None,
    "off": dict(mode=Mode.OFF),
    "bf16": dict(mode=Mode.BF16, error_feedback=False),
    "euclidean": dict(mode=Mode.EUCLIDEAN, error_feedback=False),
    "euclidean+error-feedback": dict(mode=Mode.EUCLIDEAN, error_feedback=True),
    "gift (statistics, transforms)": dict(mode=Mode.GIFT, error_feedback=False),
    "gift+error-feedback": dict(mode=Mode.GIFT, error_feedback=True),
    "gift+error-feedback+telemetry": dict(mode=Mode.GIFT, error_feedback=True, log_interval=1),
    # the two-level exchange (nodes of 2 ranks; from 4 ranks): BF16 intra-node stage, coded inter-node stage
    "euclidean two-level": dict(mode=Mode.EUCLIDEAN, ranks_per_node=2),
    "gift two-level": dict(mode=Mode.GIFT, ranks_per_node=2),
    "gift two-level nvfp4": dict(mode=Mode.GIFT, ranks_per_node=2, inter_node_format=InterNodeFormat.NVFP4),
    "gift nvfp4": dict(mode=Mode.GIFT, inter_node_format=InterNodeFormat.NVFP4),
    "gift nvfp4+error-feedback": dict(mode=Mode.GIFT, inter_node_format=InterNodeFormat.NVFP4, error_feedback=True),
    # the fused kernels' path (CUDA's), here under Triton's interpreter: what its launches allocate
    "euclidean fused": dict(mode=Mode.EUCLIDEAN, error_feedback=False, kernels=True),
    "euclidean+error-feedback fused": dict(mode=Mode.EUCLIDEAN, error_feedback=True, kernels=True),
    "gift fused": dict(mode=Mode.GIFT, error_feedback=False, kernels=True),
    "gift+error-feedback fused": dict(mode=Mode.GIFT, error_feedback=True, kernels=True),
    "euclidean two-level fused": dict(mode=Mode.EUCLIDEAN, ranks_per_node=2, kernels=True),
    "gift two-level fused": dict(mode=Mode.GIFT, ranks_per_node=2, kernels=True),
    "gift nvfp4 fused": dict(mode=Mode.GIFT, inter_node_format=InterNodeFormat.NVFP4, kernels=True),
    "gift nvfp4+error-feedback fused": dict(
        mode=Mode.GIFT, inter_node_format=InterNodeFormat.NVFP4, error_feedback=True, kernels=True
    ),
    "gift two-level nvfp4 fused": dict(
        mode=Mode.GIFT, ranks_per_node=2, inter_node_format=InterNodeFormat.NVFP4, kernels=True
    ),
}
TWO_LEVEL = tuple(n for n, c in CONFIGS.items() if c and c.get("ranks_per_node"))
QUICK_CONFIGS = ("stock", "off", "euclidean", "gift+error-feedback")


def _steady_ahead(ddp) -> bool:
    """Whether the step measured next is steady: the closing ``zero_grad_buffer`` opens an empty step
    (no backward: nothing refreshes), the measured step the one after; neither it nor the last step
    with a backward (whose refresh it would install) refreshes. Stock Megatron: always."""
    state = getattr(ddp, "gift_state", None)
    return state is None or not (state.is_refresh_step(state.step) or state.is_refresh_step(state.step + 2))


def _arena_bytes(ddp) -> int:
    """Bytes of the DDP's reduction arena (0: Megatron's DDP, or none allocated)."""
    arena = getattr(getattr(ddp, "queue", None), "arena", None)
    return 0 if arena is None or arena.buffer is None else arena.buffer.numel()


def _measure(name: str, spec: dict) -> dict:
    """``peak`` and ``held`` bytes of one configuration on this rank (see module doc)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel
    from megatron_gift.testing.gpt import build_tiny_gpt, lm_loss, random_tokens

    Arena.forget_shared()  # this configuration's arena alone, not one sized by the configurations before
    model = build_tiny_gpt(**spec["model"])
    params = sum(p.numel() for p in model.parameters())
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True)
    tracker = LiveBytes()
    with tracker:
        if CONFIGS[name] is None:
            ddp = DistributedDataParallel(model.config, ddp_config, model)
        else:
            gift = GiftConfig.build(**CONFIGS[name])
            ddp = GiftDistributedDataParallel(model.config, ddp_config, model, gift_config=gift)

        def step(i: int) -> None:
            ddp.zero_grad_buffer()  # noqa: F821  (closes the step before: error feedback committed, telemetry written)
            lm_loss(ddp, random_tokens(i, parallel_state.get_data_parallel_rank())).backward()  # noqa: F821
            ddp.finish_grad_sync()  # noqa: F821

        for i in range(spec["steps"]):
            step(i)
        ddp.zero_grad_buffer()
        gc.collect()
        out = dict(peak=tracker.peak, held=tracker.live, params=params, arena=_arena_bytes(ddp))
        if spec["steady_step"] is not None:
            i = spec["steps"]
            while i < spec["steady_step"] or not _steady_ahead(ddp):
                step(i)
                i += 1
            ddp.zero_grad_buffer()
            gc.collect()
            tracker.peak = start = tracker.live
            step(i)
            out["steady"] = tracker.peak - start
            if isinstance(ddp, GiftDistributedDataParallel):
                out["steady_step"] = ddp.gift_state.step
    del ddp, model
    gc.collect()
    return out


@contextlib.contextmanager
def collected_launches():
    """Collect garbage after each launch under Triton's interpreter, whose launch keeps every tensor
    argument's storage in a reference cycle (a recursive closure over a dict of them) until the next
    collection: a kernel's output dropped by its caller would otherwise stay counted, as on CUDA it
    does not."""
    from triton.runtime.interpreter import GridExecutor

    launch = GridExecutor.__call__

    def launch_and_collect(self, *args, **kwargs):
        try:
            return launch(self, *args, **kwargs)
        finally:
            gc.collect()

    GridExecutor.__call__ = launch_and_collect
    try:
        yield
    finally:
        GridExecutor.__call__ = launch


def _rank_main(rank: int, world: int, spec: dict, names: tuple) -> dict:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    with collected_launches() if interpreted else contextlib.nullcontext():
        # a run before the measured ones allocates the process-wide buffers (Megatron's global memory buffer
        # of the attention), which the first configuration measured would otherwise pay for alone
        _measure("stock", dict(spec, steps=1, steady_step=None))
        out = {name: _measure(name, spec) for name in names if world >= 4 or name not in TWO_LEVEL}
    parallel_state.destroy_model_parallel()
    return out


def summarize(per_rank: list[dict], world: int) -> list[dict]:
    """Rows of the table for one data-parallel size: per configuration, bytes per parameter over ``stock``,
    each the largest over the ranks (the transient a rank's own peak over its own held: the ranks holding
    the most need not be those peaking highest)."""
    rows = []
    for name in per_rank[0]:

        def extra(key, name=name):
            return max((r[name][key] - r["stock"][key]) / r[name]["params"] for r in per_rank)

        def transient(r, name=name):  # one rank's peak over its own held, less stock's
            return ((r[name]["peak"] - r[name]["held"]) - (r["stock"]["peak"] - r["stock"]["held"])) / r[name]["params"]

        row = dict(
            ranks=world,
            config=name,
            params=per_rank[0][name]["params"],
            peak_extra_B_per_param=round(extra("peak"), 3),
            held_extra_B_per_param=round(extra("held"), 3),
            transient_extra_B_per_param=round(max(transient(r) for r in per_rank), 3),
            arena_B_per_param=round(max(r[name]["arena"] / r[name]["params"] for r in per_rank), 3),
            peak_bytes_per_rank=[r[name]["peak"] for r in per_rank],
            held_bytes_per_rank=[r[name]["held"] for r in per_rank],
        )
        if "steady" in per_rank[0][name]:
            row["steady_transient_extra_B_per_param"] = round(extra("steady"), 3)
            if "steady_step" in per_rank[0][name]:
                row["steady_step"] = per_rank[0][name]["steady_step"]
        rows.append(row)
    return rows


def run(
    quick: bool = False, json_path: str | None = None, ranks=None, command: str | None = None, configs=None
) -> dict:
    """Measure every configuration (``configs``: names of ``CONFIGS``, else all; ``stock`` always) at
    every data-parallel size, print the table, write JSON."""
    from megatron_gift.testing import run_on_ranks

    spec = dict(PRESETS["quick" if quick else "default"])
    if ranks:
        spec["ranks"] = tuple(ranks)
    names = QUICK_CONFIGS if quick else tuple(CONFIGS)
    if configs:
        unknown = set(configs) - set(CONFIGS)
        if unknown:
            raise ValueError(f"unknown configurations {sorted(unknown)}; known: {', '.join(CONFIGS)}")
        names = ("stock", *(n for n in configs if n != "stock"))
    t0, rows = time.time(), []
    if any((CONFIGS[n] or {}).get("kernels") for n in names):  # the ranks inherit it: set before triton loads
        os.environ["TRITON_INTERPRET"] = "1"
    for world in spec["ranks"]:
        print(f"[bench memory] {len(names)} configurations on {world} ranks ...", file=sys.stderr, flush=True)
        rows += summarize(run_on_ranks(_rank_main, world, spec, names, cpu_harness=True, timeout=3600), world)
    doc = dict(
        benchmark="memory",
        command=command or "megatron-gift bench memory" + (" --quick" if quick else ""),
        machine=machine(),
        spec=dict(
            spec,
            configs={n: CONFIGS[n] and {k: getattr(v, "value", v) for k, v in CONFIGS[n].items()} for n in names},
            ddp="distributed optimizer, overlap_grad_reduce, default bucket size (one bucket), FP32 gradients",
        ),
        definition=__doc__.split("\n\n")[1].replace("\n", " "),
        wall_seconds=round(time.time() - t0, 1),
        results=rows,
    )
    print(format_table(rows))
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


SCALE = dict(dp=512, ranks_per_node=8, bucket=512 * 2**20, params_per_rank=2 * 10**9, dtype="bfloat16", stated_mib=1024)


def at_scale(json_path: str | None = None, command: str | None = None) -> dict:
    """The message buffers of one Megatron bucket at DP 512 (max(40M, 1M x DP) elements, one GIFT-coded
    weight, BF16 gradients, nodes of 8) as each reduction's ``footprint()`` computes them from the
    layout (the most any rank takes), and the arena an 8B model's 2B parameters per pipeline rank
    (four such buckets) get: by default two of the largest bucket's, against all four in flight; and
    with a stated ``--gift-inflight-mb`` (``stated_mib``), the sub-buckets (``comm.rounds.plan``) each
    bucket is reduced in and the largest one's footprint."""
    from megatron_gift.comm.fp4_reduce import FP4Reduce, FP4TwoLevelReduce
    from megatron_gift.comm.hierarchical import TwoLevelReduce
    from megatron_gift.comm.layout import BucketLayout, Segment
    from megatron_gift.comm.quantized import QuantizedReduce
    from megatron_gift.comm.rounds import plan
    from megatron_gift.comm.topology import Topology, TwoLevelGroups
    from megatron_gift.numerics import CodecConfig
    from megatron_gift.numerics.fp4 import FP4_FORMATS
    from megatron_gift_tools.bench.refresh import StubGroup

    dp, g, numel = SCALE["dp"], SCALE["ranks_per_node"], SCALE["bucket"]
    cols = 8192
    layout = BucketLayout(
        numel, dp, [Segment(0, numel // cols, cols, Mode.GIFT, "w")], CodecConfig("e4m3", "block"), torch.bfloat16
    )
    flat = torch.empty(numel, dtype=torch.bfloat16, device="meta")
    topology, nvfp4 = Topology(dp // g, g), FP4_FORMATS["nvfp4"]
    groups = TwoLevelGroups(StubGroup(dp), topology, StubGroup(g), StubGroup(dp // g))
    kinds = {  # (all_reduce, layout) -> the reduction; no transforms (a footprint does not depend on them)
        "flat fp8": lambda ar, lay: QuantizedReduce(flat, lay, groups.group, [None] * len(lay.segments), all_reduce=ar),
        "two-level fp8 (bf16 intra-node)": lambda ar, lay: TwoLevelReduce(
            flat, lay, groups, [None] * len(lay.segments), all_reduce=ar
        ),
        "flat nvfp4": lambda ar, lay: FP4Reduce(
            flat, lay, groups.group, [None] * len(lay.segments), nvfp4, all_reduce=ar
        ),
        "two-level nvfp4 (bf16 intra-node)": lambda ar, lay: FP4TwoLevelReduce(
            flat, lay, groups, [None] * len(lay.segments), nvfp4, all_reduce=ar
        ),
    }
    buckets = -(-SCALE["params_per_rank"] // numel)
    stated = SCALE["stated_mib"] << 20
    rows = []
    for name, make in kinds.items():
        for all_reduce in (False, True):
            need = make(all_reduce, layout).footprint()
            rounds, worst = [layout], need  # within the stated bound: whole, as the DDP reduces it
            if need > stated:
                rounds, worst = plan(
                    layout, lambda r, ar=all_reduce, mk=make: mk(ar, r.layout).footprint(), need, stated
                )
            rows.append(
                dict(
                    reduction=name,
                    collective="all-reduce" if all_reduce else "reduce-scatter",
                    footprint_B_per_element=round(need / numel, 3),
                    footprint_GiB=round(need / 2**30, 3),
                    all_buckets_GiB=round(buckets * need / 2**30, 2),
                    arena_GiB=round(min(2, buckets) * need / 2**30, 2),
                    sub_buckets=None if rounds is None else len(rounds),
                    sub_bucket_GiB=None if worst is None else round(worst / 2**30, 3),
                )
            )
    doc = dict(
        benchmark="memory-at-scale",
        command=command or "megatron-gift bench memory --at-scale",
        machine=machine(),
        spec=dict(SCALE, buckets=buckets, cols=cols),
        definition=at_scale.__doc__.replace("\n    ", " "),
        results=rows,
    )
    for r in rows:
        print(
            f"{r['reduction']:36s} {r['collective']:15s} {r['footprint_B_per_element']:6.3f} B/element "
            f"{r['footprint_GiB']:6.3f} GiB per bucket; {buckets} buckets in flight {r['all_buckets_GiB']:6.2f} GiB, "
            f"default arena {r['arena_GiB']:6.2f} GiB; stated {SCALE['stated_mib']} MiB: {r['sub_buckets']} "
            f"sub-buckets of at most {r['sub_bucket_GiB']} GiB"
        )
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


def format_table(rows: list[dict]) -> str:
    """Configurations down, data-parallel sizes across: peak extra (held, of which the arena, +
    transient) bytes per parameter, and a steady step's transient where measured."""
    sizes = sorted({r["ranks"] for r in rows})
    by = {(r["config"], r["ranks"]): r for r in rows}
    steady = any("steady_transient_extra_B_per_param" in r for r in rows)
    peak = "peak (held, of which arena, + transient)"
    what = f"{peak}, steady transient" if steady else peak
    head = "| configuration | " + " | ".join(f"{n} ranks: {what} B/param" for n in sizes) + " |"
    lines = [head, "|---|" + "---|" * len(sizes)]
    for name in dict.fromkeys(r["config"] for r in rows):
        cells = []
        for n in sizes:
            r = by.get((name, n))
            cell = (
                ""
                if r is None
                else (
                    f"{r['peak_extra_B_per_param']:.2f} ({r['held_extra_B_per_param']:.2f}"
                    + (f" of which arena {r['arena_B_per_param']:.2f}" if r.get("arena_B_per_param") else "")
                    + f" + {r['transient_extra_B_per_param']:.2f})"
                )
            )
            if r is not None and "steady_transient_extra_B_per_param" in r:
                cell += f", {r['steady_transient_extra_B_per_param']:.2f}"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
