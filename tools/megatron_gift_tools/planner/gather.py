"""The parameter all-gather before the first forward, in the order the code runs it.

Megatron's ``--overlap-param-gather``: bucket k's forward pre-hook waits for bucket k's gather and
then dispatches bucket k+1's. Its BF16 ring gathers queue back to back on their NCCL stream (the
host is ahead), each bucket's forward waits for its own. The delta gather (``comm/param_delta.py``)
adds an encode of the own shard before the all-gather and a decode of every shard after it; with
the decode on the compute stream (``DecodeStream.COMPUTE``, the unfused decode) the compute stream runs
``encode 0``, then per bucket ``decode k, encode k+1, forward k``, and gather k+1 starts only after
encode k+1: decode and encode are on the critical path. With the decode on a side stream the
gathers queue back to back again and only the forward waits for each decode.
"""

from __future__ import annotations

from megatron_gift.config import ParamGather
from megatron_gift_tools.planner.delta import DecodeStream
from megatron_gift_tools.planner.metered import ONE_PASS
from megatron_gift_tools.planner.simulate import simulate
from megatron_gift_tools.planner.tasks import Context, Task

COMPUTE = "compute"
"""the stream name of work that runs on the compute stream, in program order with the forward."""


def gather_chain(elements: int, x: Context) -> list[Task]:
    """One bucket's parameter all-gather after the optimizer step: Megatron's BF16 ring all-gather, or the
    delta gather (the owner encodes its shard's change, a ring all-gather of the codes, every rank decodes)."""
    if x.p == 1:
        return []
    if x.opts.param_gather is ParamGather.BF16:
        return [x.ring("all-gather", "all_gather", 2.0 * elements, "param-gather", 1)]
    k, bpe, shard = x.opts.delta_kernels, x.opts.delta.bytes_per_element, elements / x.p
    on_compute = k.stream is DecodeStream.COMPUTE
    m = x.costs.meter
    enc, dec = [ONE_PASS if m is None else m.delta(stage, x.p, elements) for stage in ("encode", "decode")]
    encode = x.gpu(
        "delta encode", 1, k.encode_bytes * shard, stream=COMPUTE if on_compute else "delta-encode", count=enc
    )
    decode = x.gpu(
        "delta decode",
        2,
        k.decode_bytes * elements + k.prev_bytes * shard,
        stream=COMPUTE if on_compute else "delta-decode",
        count=dec,
    )
    return [encode, x.ring("delta all-gather", "all_gather", bpe * elements, "param-gather", 1), decode]


def forward_phase(fwd: list[float], gathers: list[list[Task]], refresh: list[Task], overlap: float) -> float:
    """Seconds the parameter gathers (in forward order, one per bucket; none: no overlapped gather) and a
    refresh's work add to the first forward (chunks ``fwd``, the same order). Work on the compute stream
    becomes compute chunks in program order (module doc); the refresh's chain is enqueued last."""
    chains = [[t for t in g if t.stream != COMPUTE] for g in gathers]
    mine = [[t.seconds for t in g if t.stream == COMPUTE] for g in gathers]
    if not any(mine):
        chunks, release, waits = list(fwd), [None] * len(chains), list(range(len(chains))) or [None] * len(fwd)
    else:  # encode 0 | decode 0 + encode 1 | forward 0 | decode 1 + encode 2 | forward 1 | ...
        encode, decode = [m[0] for m in mine] + [0.0], [m[1] for m in mine]
        chunks, release, waits = [encode[0]], [0], [None]
        for k, f in enumerate(fwd):
            chunks += [decode[k] + encode[k + 1], f]
            waits += [k, None]
            if k + 1 < len(chains):
                release.append(len(chunks) - 2)  # gather k+1 after encode k+1
    _, end = simulate(chunks, chains + [refresh], release + [None], waits, overlap)
    return end - sum(fwd)
