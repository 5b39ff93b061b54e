"""GIFT state in Megatron's distributed checkpoints (``--ckpt-format torch_dist``).

``megatron.training`` saves and loads the *unwrapped* model, so the DDP wrapper's state never
reaches the checkpoint on its own. :func:`checkpoint_hooks` wraps two functions of
``megatron.training.checkpointing`` (both looked up by name when called):

* ``generate_state_dict`` (save and load) adds, per model chunk ``i``, ``ShardedObject`` s:
  ``gift.chunk{i}.dense`` (step, modes, transforms and damping choices of the dense parameters;
  global shape ``(pp, tp)``, one replica per data-parallel(+context) rank),
  ``gift.chunk{i}.expert`` (expert weights; ``(pp, expert-tp, ep)``, replicas over the expert
  data-parallel group), ``gift.chunk{i}.local`` (``{name: {side: ...}}``, each side's state that is
  this rank's own, ``state.PER_RANK``: its K-FAC statistics, a local per-step EMA summed over ranks
  only at a refresh, and on the rank that builds the layer the held-out ``T`` for the cold-start
  rule and the factor; ``(world,)``) and, with error
  feedback, ``gift.chunk{i}.residuals`` (this rank's own residuals; ``(world,)``). A common entry
  ``gift_meta`` (saved by rank 0) records the layout.
* ``_load_base_checkpoint``: its first call (``rank0=True``, the common state) yields
  ``gift_meta``, which decides what the load requests: nothing without GIFT state or with
  another TP/PP/EP layout, everything but the per-rank parts with another data-parallel size; the
  second call's result is handed to each :class:`GiftDistributedDataParallel`. Every decision is
  logged on rank 0.

Version 1 (before ``state.SideState``) kept the output side's state beside the input side's and the
per-rank ``T`` and factors under ``#held_out`` / ``#factor``; it is read and upgraded
(``state.upgrade_entry``).

A GIFT state that does not fit this run (another ``gift_meta`` version, other shapes, missing or
garbled entries) is never half-applied and never fails the load: the message says why and the
GIFT state starts fresh (the rest of the checkpoint loads as usual).

Other checkpoint formats keep working but carry no GIFT state (a warning says so).
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import torch.distributed as dist

from ..state import PER_RANK, upgrade_entry

META_KEY = "gift_meta"
STATE_KEY = "gift"
VERSION = 2
READS = (1, VERSION)  # the versions a load reads (1: upgraded, ``merge_state``)
# version 1's per-rank part: {name: the factor owner's held-out T} and {name: its factors} beside the statistics
V1_PER_RANK = {"held_out": "#held_out", "factor": "#factor"}


def _log(msg: str, *args) -> None:
    """One line on rank 0, next to Megatron's own checkpoint messages."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("megatron-gift: " + msg % args, flush=True)


def layout() -> dict:
    """This run's parallel layout, as recorded in ``gift_meta``."""
    from megatron.core import parallel_state as ps

    return {
        "world": dist.get_world_size(),
        "dp": ps.get_data_parallel_world_size(with_context_parallel=True),
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
    }


def sharded_objects(
    ddp, chunk: int, parts=("dense", "expert", "local", "residuals"), state: dict | None = None
) -> dict:
    """``{key: ShardedObject}`` of one model chunk's GIFT state (``data=None`` to describe a load)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    where = {
        "dense": (
            (pp, ps.get_tensor_model_parallel_world_size(), 1),
            (pp_rank, ps.get_tensor_model_parallel_rank(), 0),
            ps.get_data_parallel_rank(with_context_parallel=True),
        ),
        "expert": (
            (pp, ps.get_expert_tensor_parallel_world_size(), ps.get_expert_model_parallel_world_size()),
            (pp_rank, ps.get_expert_tensor_parallel_rank(), ps.get_expert_model_parallel_rank()),
            ps.get_expert_data_parallel_rank(),
        ),
        "residuals": ((dist.get_world_size(),), (dist.get_rank(),), 0),
    }
    where["local"] = where["residuals"]
    data = split_state(ddp, state) if state is not None else {}
    out = {}
    for part in parts:
        if part == "expert" and not any(gp.expert for gp in ddp.gift_params.values()):
            continue
        if part == "residuals" and not ddp.gift_config.wire.error_feedback:
            continue
        if part == "local" and not any(gp.input.stats is not None for gp in ddp.gift_params.values()):
            continue
        shape, offset, replica = where[part]
        key = f"{STATE_KEY}.chunk{chunk}.{part}"
        out[key] = ShardedObject(key, data.get(part), shape, offset, replica_id=replica)
    return out


def split_state(ddp, state: dict) -> dict:
    """``gift_state_dict()`` output split into the dense, expert and per-rank parts (each side's
    ``state.PER_RANK`` keys; the residual)."""
    expert = {gp.name for gp in ddp.gift_params.values() if gp.expert}
    parts = {
        "dense": {"step": state["step"], "params": {}},
        "expert": {"step": state["step"], "params": {}},
        "local": {},
        "residuals": {},
    }
    for part in ("dense", "expert"):  # decisions are keyed by parameter name: each part keeps all
        if "policy" in state:
            parts[part]["policy"] = state["policy"]
    for name, entry in state["params"].items():
        entry = dict(entry)
        if "residual" in entry:
            parts["residuals"][name] = entry.pop("residual")
        if "sides" in entry:
            entry["sides"] = {side: dict(kept) for side, kept in entry["sides"].items()}
            for side, kept in entry["sides"].items():
                mine = {key: kept.pop(key) for key in PER_RANK if key in kept}
                if mine:
                    parts["local"].setdefault(name, {})[side] = mine
        parts["expert" if name in expert else "dense"]["params"][name] = entry
    return parts


def merge_state(loaded: dict, version: int = VERSION) -> dict:
    """Inverse of :func:`split_state` over whichever parts were loaded; a ``version`` 1 checkpoint's
    parts are merged as that version split them, each entry then upgraded."""
    if version == 1:
        return _merge_v1(loaded)
    state = {"step": None, "params": {}}
    for part in ("dense", "expert"):
        if part in loaded:
            state["step"] = loaded[part]["step"]
            state["params"].update({name: dict(entry) for name, entry in loaded[part]["params"].items()})
            if "policy" in loaded[part]:
                state["policy"] = loaded[part]["policy"]
    for name, value in loaded.get("residuals", {}).items():
        state["params"].setdefault(name, {})["residual"] = value
    for name, sides in loaded.get("local", {}).items():
        entry = state["params"].setdefault(name, {})
        entry["sides"] = {side: dict(kept) for side, kept in entry.get("sides", {}).items()}  # not in place
        for side, mine in sides.items():
            entry["sides"].setdefault(side, {}).update(mine)
    return state


def _merge_v1(loaded: dict) -> dict:
    """:func:`merge_state` of a version 1 checkpoint (statistics under the name, the held-out ``T`` and
    factors under ``V1_PER_RANK``'s keys; the output side nested as ``"out"``), entries upgraded."""
    state = {"step": None, "params": {}}
    for part in ("dense", "expert"):
        if part in loaded:
            state["step"] = loaded[part]["step"]
            state["params"].update(
                {name: dict(entry) for name, entry in loaded[part]["params"].items()}
            )  # not in place
            if "policy" in loaded[part]:
                state["policy"] = loaded[part]["policy"]
    for key, part in (("residual", "residuals"), ("stats", "local")):
        for name, value in loaded.get(part, {}).items():
            if name not in V1_PER_RANK.values():
                state["params"].setdefault(name, {})[key] = value
    for key, bucket in V1_PER_RANK.items():
        held = loaded.get("local", {}).get(bucket, {})
        for name, value in held.items() if isinstance(held, dict) else ():
            state["params"].setdefault(name, {})[key] = value
    state["params"] = {name: upgrade_entry(entry) for name, entry in state["params"].items()}
    return state


class _Hooks:
    """The wrapped ``generate_state_dict`` / ``_load_base_checkpoint`` and what they share."""

    def __init__(self, instances: list):
        self.instances = instances  # every GiftDistributedDataParallel built inside the block
        self.meta: dict | None = None  # gift_meta of the checkpoint being loaded
        self.loading: list = []  # the GIFT DDP of each model chunk being loaded into
        self.warned_format = False

    def chunks(self, model) -> list:
        """The GIFT DDP wrapping each (unwrapped) model chunk, or None."""
        from megatron.core.utils import unwrap_model

        by_module = {id(unwrap_model(d)): d for d in self.instances}
        return [by_module.get(id(m)) for m in model]

    def generate(self, original):
        @functools.wraps(original)  # upstream's source stays reachable (upstream.fingerprint)
        def generate_state_dict(args, model, *a, **kw):
            state_dict = original(args, model, *a, **kw)
            chunks = self.chunks(model)
            if not any(c is not None for c in chunks):
                return state_dict
            if args.ckpt_format != "torch_dist":
                if not self.warned_format:
                    _log("--ckpt-format %s: GIFT state is not saved or loaded (use torch_dist)", args.ckpt_format)
                    self.warned_format = True
                return state_dict
            loading = bool((kw.get("optim_sd_kwargs") or {}).get("is_loading"))
            if loading:
                parts = self.parts_to_load()
                self.loading = chunks
                for i, ddp in enumerate(chunks):
                    if ddp is not None and parts:
                        state_dict.update(sharded_objects(ddp, i, parts))
            else:
                state_dict[META_KEY] = {"version": VERSION, **layout(), "chunks": len(chunks)}
                for i, ddp in enumerate(chunks):
                    if ddp is not None:
                        state_dict.update(sharded_objects(ddp, i, state=ddp.gift_state_dict()))
            return state_dict

        return generate_state_dict

    def parts_to_load(self) -> tuple[str, ...]:
        """What the checkpoint being loaded can give this run, from its ``gift_meta`` (logged)."""
        meta, now = self.meta, layout()
        if meta is None:
            _log("the checkpoint has no GIFT state: statistics, transforms and error feedback start fresh")
            return ()
        if not isinstance(meta, dict) or meta.get("version") not in READS:
            version = meta.get("version") if isinstance(meta, dict) else meta
            _log(
                "the checkpoint's GIFT state has format version %r, this megatron-gift reads version %d: "
                "starting it fresh",
                version,
                VERSION,
            )
            return ()
        changed = [k for k in ("tp", "pp", "ep", "etp") if meta.get(k) != now[k]]
        if changed:
            _log(
                "the checkpoint's GIFT state was written with another layout (%s); starting it fresh",
                ", ".join(f"{k} {meta.get(k)} -> {now[k]}" for k in changed),
            )
            return ()
        if meta["world"] != now["world"]:
            _log(
                "the checkpoint was written by %d ranks (data-parallel %d), this run has %d (data-parallel %d): "
                "GIFT transforms restored; K-FAC statistics and error-feedback residuals (per rank) start afresh",
                meta["world"],
                meta["dp"],
                now["world"],
                now["dp"],
            )
            return ("dense", "expert")
        return ("dense", "expert", "local", "residuals")

    def load(self, original):
        @functools.wraps(original)
        def _load_base_checkpoint(load_dir, args, rank0=False, *a, **kw):
            result = original(load_dir, args, rank0, *a, **kw)
            state_dict = result[0]
            if rank0:
                self.meta = state_dict.get(META_KEY) if isinstance(state_dict, dict) else None
                return result
            for ddp in self.instances:  # the weights change outside the optimizer: gather them in full next
                ddp.restart_param_gather()
            chunks, self.loading = self.loading, []
            if not isinstance(state_dict, dict):
                return result
            resume_local = self.meta is not None and self.meta["world"] == dist.get_world_size()
            for i, ddp in enumerate(chunks):
                loaded = {
                    key.rsplit(".", 1)[1]: state_dict.pop(key)
                    for key in list(state_dict)
                    if key.startswith(f"{STATE_KEY}.chunk{i}.")
                }
                if ddp is not None and loaded and restore(ddp, loaded, resume_local, self.meta["version"]):
                    _log("GIFT state restored (step %d)", ddp.step)
            state_dict.pop(META_KEY, None)
            return result

        return _load_base_checkpoint


def restore(ddp, loaded: dict, local: bool = True, version: int = VERSION) -> bool:
    """Load the parts ``loaded`` (``{"dense"|"expert"|"local"|"residuals": object}``, written by checkpoint
    format ``version``) into ``ddp``; True if they were applied. A state that does not fit (garbled,
    truncated, other shapes) leaves ``ddp`` as it was before (fresh) and says why: False."""
    fresh = ddp.gift_state_dict()
    reason = misfit(ddp, loaded, local, version)
    if reason is not None:
        _log(
            "the checkpoint's GIFT state does not fit this run (%s): statistics, transforms and error feedback "
            "start fresh",
            reason,
        )
        return False
    try:
        ddp.load_gift_state_dict(merge_state(loaded, version), local=local)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        ddp.load_gift_state_dict(fresh)
        for gp in ddp.gift_params.values():  # a transform loaded before the failure: none when fresh
            sides = fresh["params"][gp.name].get("sides", {})
            if "whitening" not in sides.get("input", {}):
                gp.input.factor = gp.input.whitening = None
            if gp.output is not None and "whitening" not in sides.get("output", {}):
                gp.output.factor = gp.output.whitening = None
                if gp.output.stats is None:
                    gp.output = None
        _log(
            "the checkpoint's GIFT state does not fit this run (%s: %s): statistics, transforms and error "
            "feedback start fresh",
            type(e).__name__,
            e,
        )
        return False
    return True


def misfit(ddp, loaded: dict, local: bool = True, version: int = VERSION) -> str | None:
    """Why the parts ``loaded`` cannot be restored into ``ddp`` (garbled or truncated parts, statistics
    or transforms of other shapes: another model width or ``--gift-sketch``), or None."""
    for part, value in loaded.items():
        if not isinstance(value, dict):
            return f"part {part!r} is {type(value).__name__}, not a GIFT state (garbled)"
        if part in ("dense", "expert") and not {"step", "params"} <= value.keys():
            return f"part {part!r} lacks {sorted({'step', 'params'} - value.keys())} (truncated)"
    try:
        params = merge_state(loaded, version)["params"]
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # an entry of another shape inside a part
        return f"its parts do not merge ({type(e).__name__}: {e}; garbled)"
    for p, gp in ddp.gift_params.items():
        entry = params.get(gp.name)
        if not isinstance(entry, dict) or gp.input.stats is None:
            continue  # a parameter without saved state starts fresh, named by load_gift_state_dict
        # each side's statistics and transform (the output side's: --gift-side both / auto)
        sides = entry.get("sides", {})
        for side, d in (("input", gp.input.stats.d_in), ("output", p.shape[0])):
            saved = sides.get(side, {})
            stats = getattr(gp, side).stats if getattr(gp, side) is not None else None
            reason = _side_misfit(
                gp.name, stats, saved.get("stats") if local else None, saved.get("whitening"), side, d
            )
            if reason is not None:
                return reason
    return None


def _side_misfit(name: str, stats, saved_stats, saved_whitening, size: str, d: int) -> str | None:
    """Why one side's saved statistics or transform do not fit this run's ``stats`` (None: none kept on
    that side) and the layer's ``d`` inputs or outputs (None: they fit). A ``T_out`` is restored even
    where this run keeps no output statistics (``GiftState``: the next refresh replaces it)."""
    for key in ("sums", "ema_sums") if stats is not None and isinstance(saved_stats, dict) else ():
        saved = saved_stats.get(key) or {}
        if key == "ema_sums" and not saved:
            continue  # saved before the first fold
        if saved.keys() != stats.sums.keys():
            return (
                f"{name}: saved statistics {sorted(saved)}, this run keeps {sorted(stats.sums)} (another --gift-sketch)"
            )
        for k, t in stats.sums.items():
            if tuple(saved[k].shape) != tuple(t.shape):
                return (
                    f"{name}: saved statistics {k} of shape {tuple(saved[k].shape)}, this run's is "
                    f"{tuple(t.shape)} (another layer width or --gift-sketch)"
                )
    w = saved_whitening or {}
    if w and ("q" not in w or any(w[k].shape[0] != d for k in ("q", "d_sqrt", "d_inv_sqrt") if k in w)):
        return f"{name}: saved transform for {size} size {w['q'].shape[0] if 'q' in w else '?'}, the layer has {d}"
    return None


@contextlib.contextmanager
def checkpoint_hooks(instances: list):
    """Within the block, Megatron's checkpoints carry the GIFT state of ``instances`` (see module doc)."""
    module = importlib.import_module("megatron.training.checkpointing")
    hooks = _Hooks(instances)
    saved = {name: getattr(module, name) for name in ("generate_state_dict", "_load_base_checkpoint")}
    module.generate_state_dict = hooks.generate(saved["generate_state_dict"])
    module._load_base_checkpoint = hooks.load(saved["_load_base_checkpoint"])
    try:
        yield hooks
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
