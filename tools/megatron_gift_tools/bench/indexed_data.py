"""The benchmark corpus as a Megatron indexed dataset (``.bin`` / ``.idx``) for ``--data-path``.

:func:`write_indexed_dataset` writes the tokens of a :class:`~megatron_gift_tools.bench.corpus.TokenCorpus`
with Megatron-Core's own ``IndexedDatasetBuilder``: one sequence and one document per
EOT-terminated document (the EOT token stays at the end of its document, as Megatron's
``preprocess_data.py --append-eod`` writes it). The files sit next to the corpus cache, named
after the corpus cache key (``indexed-<corpus format>-<sha16>-<vocab>.bin/.idx``), so a
different corpus, tokenization or vocabulary never reuses them. Writing goes through temporary names and a rename,
the ``.idx`` last, so a concurrent reader never sees a partial dataset.

Megatron needs no tokenizer file to read the dataset: ``GPTDataset`` only asks the tokenizer
for its EOD (and pad) id. :func:`megatron_data_args` gives the flags that say so with Megatron's
``NullTokenizer`` (``--tokenizer-type NullTokenizer --vocab-size V --null-tokenizer-eod-id E``).

``python -m megatron_gift_tools.bench.indexed_data [--vocab-size N]`` builds the files and prints those
flags.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from megatron_gift_tools.bench.corpus import TokenCorpus, build_token_corpus


def indexed_prefix(corpus: TokenCorpus) -> Path:
    """Path prefix of ``corpus``'s indexed dataset: ``<cache>/indexed-<corpus key>``, next to its tokenizer."""
    stem = corpus.tokenizer_path.stem  # bpe-<corpus format>-<sha16>-<vocab>
    key = stem.split("-", 1)[1] if stem.startswith("bpe-") else stem
    return corpus.tokenizer_path.parent / f"indexed-{key}"


def document_lengths(tokens: np.ndarray, eot_id: int) -> np.ndarray:
    """Length of each EOT-terminated document (EOT included); a trailing unterminated piece counts too."""
    ends = np.flatnonzero(tokens == eot_id) + 1
    if ends.size == 0 or ends[-1] != tokens.size:
        ends = np.append(ends, tokens.size)
    return np.diff(ends, prepend=0)


def write_indexed_dataset(corpus: TokenCorpus, prefix: str | os.PathLike | None = None, force: bool = False) -> str:
    """Write ``corpus`` as ``<prefix>.bin`` / ``<prefix>.idx`` unless present; return the prefix.

    ``prefix`` defaults to :func:`indexed_prefix` (next to the corpus cache). Token ids are
    stored as ``uint16`` when the vocabulary fits (as Megatron's preprocessing does), else ``int32``.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path

    prefix = str(indexed_prefix(corpus) if prefix is None else prefix)
    if not force and os.path.isfile(get_idx_path(prefix)) and os.path.isfile(get_bin_path(prefix)):
        return prefix
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    tokens = corpus.tokens.numpy()
    dtype = DType.optimal_dtype(corpus.vocab_size)
    tmp = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(get_bin_path(tmp), dtype=dtype)
    start = 0
    for length in document_lengths(tokens, corpus.eot_id).tolist():
        builder.add_document(tokens[start : start + length], [length])
        start += length
    builder.finalize(get_idx_path(tmp))
    os.replace(get_bin_path(tmp), get_bin_path(prefix))
    os.replace(get_idx_path(tmp), get_idx_path(prefix))  # last: marks a complete dataset
    return prefix


def megatron_data_args(corpus: TokenCorpus, prefix: str | None = None) -> list[str]:
    """Megatron flags that train on ``corpus``'s indexed dataset (built if missing) with ``NullTokenizer``."""
    prefix = write_indexed_dataset(corpus) if prefix is None else prefix
    return [
        "--data-path",
        prefix,
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(corpus.vocab_size),
        "--null-tokenizer-eod-id",
        str(corpus.eot_id),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_gift_tools.bench.indexed_data",
        description="Write the benchmark corpus as a Megatron indexed dataset and print the flags that use it.",
    )
    parser.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size (default: %(default)s)")
    parser.add_argument("--cache-dir", default=None, help="corpus cache directory (default: $MEGATRON_GIFT_CACHE)")
    parser.add_argument("--force", action="store_true", help="rewrite the files even if present")
    args = parser.parse_args(argv)
    corpus = build_token_corpus(args.vocab_size, cache_dir=args.cache_dir)
    prefix = write_indexed_dataset(corpus, force=args.force)
    print(" ".join(megatron_data_args(corpus, prefix)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
