"""``megatron-gift bench path``: how far one bucket's steady reduction travels through the plugin's code.

A tiny GPT in one bucket (no overlap: the whole reduction runs in ``finish_grad_sync``) on 2 gloo
ranks, GIFT with the distributed optimizer (reduce-scatter) or without (all-reduce); after the warm-up
steps, one steady step's ``finish_grad_sync`` is traced with ``sys.setprofile``. Of the Python calls
into ``megatron_gift`` it counts the distinct functions, the files, the calls, the file switches
(consecutive plugin calls in different files), the plugin classes whose methods run, and the calls
that run up a layer (a callee in a higher layer of docs/how-it-works.md than its caller: a callback
into the DDP, a kernel calling the reduction). Issue 34's target: at most ~50 functions and ~25
types, none up a layer; Megatron's own path is two methods.
"""

from __future__ import annotations

import argparse
import json
import sys

MODES = {"reduce-scatter": True, "all-reduce": False}  # the distributed optimizer on / off
PLUGIN = "megatron_gift"
# not the reduction's path: test support, and the CPU harness's torch-function mode (CUDA -> CPU), which
# wraps every torch call on a CPU run and never runs on a GPU
SKIPPED = (PLUGIN + ".testing", PLUGIN + ".megatron.cpu_harness")
# not functions a reader follows: comprehensions (inlined from Python 3.12) and dataclasses' generated methods
NOT_FUNCTIONS = ("<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>", "__create_fn__")


def _trace(fn) -> list[tuple[str, str, str, str | None]]:
    """Every Python call into the plugin while ``fn()`` runs, in call order: ``(module, file, qualname,
    the plugin class of its ``self`` or None, the caller's module)``."""
    calls = []

    def profile(frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(PLUGIN) or module.startswith(SKIPPED):
            return
        code = frame.f_code
        if any(tag in code.co_qualname for tag in NOT_FUNCTIONS):
            return
        self = frame.f_locals.get("self")
        cls = type(self).__qualname__ if self is not None and type(self).__module__.startswith(PLUGIN) else None
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back is not None else ""
        calls.append((module, code.co_filename, code.co_qualname, cls, caller))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def summarize(calls: list, table: list[tuple[str, ...]]) -> dict:
    """The counts of the module doc from traced calls (``_trace``'s records) and the layer table."""
    from megatron_gift_tools.layering import layer_of

    files = [f for _, f, _, _, _ in calls]
    upward = sorted(
        {
            f"{caller} -> {module}.{name}"
            for module, _, name, _, caller in calls
            if caller.startswith(PLUGIN) and layer_of(module, table) < layer_of(caller, table)
        }
    )
    return dict(
        functions=len({(f, name) for _, f, name, _, _ in calls}),
        files=len(set(files)),
        calls=len(calls),
        file_switches=sum(a != b for a, b in zip(files, files[1:])),
        types=sorted({cls for *_, cls, _ in calls if cls is not None}),
        functions_by_module={
            m: sorted({name for module, _, name, _, _ in calls if module == m}) for m in sorted({c[0] for c in calls})
        },
        upward_calls=upward,
    )


def _rank_main(rank: int, world: int, dist_opt: bool) -> dict:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_gift.config import GiftConfig
    from megatron_gift.megatron.ddp import GiftDistributedDataParallel
    from megatron_gift.testing.gpt import build_tiny_gpt, lm_loss, random_tokens
    from megatron_gift_tools.layering import layers

    parallel_state.initialize_model_parallel(1, 1)
    model = build_tiny_gpt()
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=dist_opt, overlap_grad_reduce=False)
    ddp = GiftDistributedDataParallel(model.config, ddp_config, model, gift_config=GiftConfig.build(mode="gift"))
    state = ddp.gift_state
    i = 0
    while True:  # warm up until the next step neither refreshes nor installs a refresh
        ddp.zero_grad_buffer()
        lm_loss(ddp, random_tokens(i, rank)).backward()
        steady = i > 2 and not (state.is_refresh_step(state.step) or state.is_refresh_step(state.step - 1))
        if steady:
            calls = _trace(ddp.finish_grad_sync)
            break
        ddp.finish_grad_sync()
        i += 1
    out = summarize(calls, layers())
    out.update(step=state.step, buckets=sum(len(bg.buckets) for bg in ddp.bucket_groups))
    parallel_state.destroy_model_parallel()
    return out


def run(json_path: str | None = None, command: str | None = None) -> dict:
    from megatron_gift.testing import run_on_ranks
    from megatron_gift_tools.bench.fidelity import machine

    rows = []
    for name, dist_opt in MODES.items():
        per_rank = run_on_ranks(_rank_main, 2, dist_opt, cpu_harness=True, timeout=900)
        row = dict(per_rank[0], reduction=name, ranks=2)
        row["same_on_every_rank"] = all(r == per_rank[0] for r in per_rank)
        rows.append(row)
    doc = dict(
        command=command or "megatron-gift bench path",
        what="one bucket's steady GIFT reduction (finish_grad_sync), 2 gloo ranks, tiny GPT in one bucket",
        target=dict(functions=50, types=25, upward_calls=0),
        machine=machine(),
        rows=rows,
    )
    for r in rows:
        print(
            f"{r['reduction']:>15}: {r['functions']} functions in {r['files']} files, {r['calls']} calls, "
            f"{r['file_switches']} file switches, {len(r['types'])} types, {len(r['upward_calls'])} calls up a layer"
        )
        for u in r["upward_calls"]:
            print(f"{'':>17}up: {u}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-gift bench path", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the counts here")
    args = parser.parse_args(argv)
    run(args.json, "megatron-gift bench path" + (f" --json {args.json}" if args.json else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
