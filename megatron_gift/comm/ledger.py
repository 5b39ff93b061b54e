"""The byte ledger of the quantized collectives: what each rank sends, by collective, dtype and link."""

from __future__ import annotations

from collections import defaultdict

from ..numerics.wire import WireFormat


def coded_label(fmt: WireFormat) -> str:
    """The ledger's dtype of messages of ``fmt``'s codes with their scales (``fp8+scales`` for E4M3 and E5M2)."""
    return f"{fmt.label}+scales"


_PLAIN_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def dtype_label(dtype) -> str:
    """The ledger's name of values sent in ``dtype``: ``fp32``, ``bf16``, ``fp16``, else torch's name."""
    return _PLAIN_NAMES.get(str(dtype), str(dtype).removeprefix("torch."))


def message_label(layout) -> str:
    """The ledger's dtype of a bucket's messages: ``coded_label`` where they carry codes; else what
    its plain parameters travel as (``bf16`` for a bucket of ``--gift-mode bf16`` parameters, which the
    ledger and ``megatron-gift report`` called ``fp8+scales``)."""
    if layout.n_coded:
        return coded_label(layout.codec.fmt)
    names = [dtype_label(d) for d, n in zip(layout.plain_dtypes, layout.n_plain) if n]
    return "+".join(dict.fromkeys(names)) or coded_label(layout.codec.fmt)


def ring_all_reduce_bytes(ranks: int, nbytes: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` over ``ranks`` ranks: a reduce-scatter
    and an all-gather, ``(R-1)/R`` of the buffer each."""
    return 2 * (ranks - 1) * nbytes // ranks


class CommLedger:
    """Bytes this rank sent, by ``(collective, dtype)``: all-to-all counts what leaves the rank,
    ring all-gather ``(R-1)·chunk``, ring reduce-scatter ``(R-1)/R·buffer``, ring all-reduce twice that
    (``ring_all_reduce_bytes``).

    ``links`` splits the quantized exchanges' bytes by ``(link, dtype)``, the link being the one
    they cross (``intra``: to a rank on the same node, ``inter``: through the NIC), as if each
    peer's bytes went to it directly."""

    def __init__(self):
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.links: dict[tuple[str, str], int] = defaultdict(int)

    def add(self, collective: str, dtype: str, nbytes: int, links: dict[str, int] | None = None) -> None:
        self.bytes[(collective, dtype)] += int(nbytes)
        for link, n in (links or {}).items():
            self.links[(link, dtype)] += int(n)

    def by_link(self) -> dict[str, int]:
        """Bytes per link (``intra``, ``inter``), every dtype together."""
        out: dict[str, int] = defaultdict(int)
        for (link, _), n in self.links.items():
            out[link] += n
        return dict(out)

    def total(self) -> int:
        return sum(self.bytes.values())

    def as_dict(self) -> dict[str, int]:
        return {f"{c}/{d}": n for (c, d), n in sorted(self.bytes.items())}

    def reset(self) -> None:
        self.bytes.clear()
        self.links.clear()
