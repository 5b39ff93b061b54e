"""Megatron indexed datasets (``.bin`` / ``.idx``) for ``--data-path``, and a small synthetic corpus that the
launcher tests train on without the tools' real-text corpus.

:func:`write_indexed_dataset` writes a token stream with Megatron-Core's own ``IndexedDatasetBuilder``: one
sequence and one document per EOT-terminated document (the EOT token stays at the end of its document, as
Megatron's ``preprocess_data.py --append-eod`` writes it). Writing goes through temporary names and a rename,
the ``.idx`` last, so a concurrent reader never sees a partial dataset. Megatron needs no tokenizer file to
read it: ``GPTDataset`` only asks the tokenizer for its EOD (and pad) id, which :func:`data_args` gives to
Megatron's ``NullTokenizer``. The tools' corpus (``megatron_gift_tools.bench.indexed_data``) writes through
these functions.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

SYNTHETIC_VOCAB = 2048
SYNTHETIC_EOT = 0


def document_lengths(tokens: np.ndarray, eot_id: int) -> np.ndarray:
    """Length of each EOT-terminated document (EOT included); a trailing unterminated piece counts too."""
    ends = np.flatnonzero(tokens == eot_id) + 1
    if ends.size == 0 or ends[-1] != tokens.size:
        ends = np.append(ends, tokens.size)
    return np.diff(ends, prepend=0)


def write_indexed_dataset(
    tokens: np.ndarray, vocab_size: int, eot_id: int, prefix: str | os.PathLike, force: bool = False
) -> str:
    """Write ``tokens`` as ``<prefix>.bin`` / ``<prefix>.idx`` unless present; return the prefix. Token ids
    are stored as ``uint16`` when the vocabulary fits (as Megatron's preprocessing does), else ``int32``."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path

    prefix = str(prefix)
    if not force and os.path.isfile(get_idx_path(prefix)) and os.path.isfile(get_bin_path(prefix)):
        return prefix
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(get_bin_path(tmp), dtype=DType.optimal_dtype(vocab_size))
    start = 0
    for length in document_lengths(tokens, eot_id).tolist():
        builder.add_document(tokens[start : start + length], [length])
        start += length
    builder.finalize(get_idx_path(tmp))
    os.replace(get_bin_path(tmp), get_bin_path(prefix))
    os.replace(get_idx_path(tmp), get_idx_path(prefix))  # last: marks a complete dataset
    return prefix


def data_args(prefix: str, vocab_size: int, eot_id: int) -> list[str]:
    """Megatron flags that train on the indexed dataset at ``prefix`` with ``NullTokenizer``."""
    return [
        "--data-path",
        prefix,
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(vocab_size),
        "--null-tokenizer-eod-id",
        str(eot_id),
    ]


def synthetic_tokens(vocab_size: int = SYNTHETIC_VOCAB, documents: int = 1000, seed: int = 0) -> np.ndarray:
    """A seeded int32 stream of ``documents`` EOT-terminated documents (16 to 255 tokens) that a model can
    learn in a few steps: Zipf-distributed tokens, three in four of them the fixed successor of the one
    before (a random table), so the loss falls from the first iterations as it does on real text."""
    rng = np.random.default_rng(seed)
    ids = np.arange(1, vocab_size)
    successor = rng.permutation(ids)
    lengths = rng.integers(16, 256, size=documents)
    draws = rng.choice(ids, size=int(lengths.sum()), p=(1.0 / ids) / (1.0 / ids).sum()).tolist()
    follow = (rng.random(len(draws)) < 0.75).tolist()
    out, i = [], 0
    for n in lengths.tolist():
        doc = [draws[i]]
        for t in range(i + 1, i + n):
            doc.append(int(successor[doc[-1] - 1]) if follow[t] else draws[t])
        out += [*doc, SYNTHETIC_EOT]
        i += n
    return np.asarray(out, dtype=np.int32)


def synthetic_data_args(folder: str | os.PathLike) -> list[str]:
    """Megatron flags that train on :func:`synthetic_tokens`, written under ``folder`` if missing."""
    prefix = write_indexed_dataset(synthetic_tokens(), SYNTHETIC_VOCAB, SYNTHETIC_EOT, Path(folder) / "synthetic")
    return data_args(prefix, SYNTHETIC_VOCAB, SYNTHETIC_EOT)
