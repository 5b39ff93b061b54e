"""The benchmark corpus as a Megatron indexed dataset (``.bin`` / ``.idx``) for ``--data-path``.

:func:`write_indexed_dataset` writes the tokens of a :class:`~megatron_gift_tools.bench.corpus.TokenCorpus`
through ``megatron_gift.testing.indexed_data`` (Megatron-Core's own ``IndexedDatasetBuilder``: one
document per EOT-terminated document, written atomically). The files sit next to the corpus cache, named
after the corpus cache key (``indexed-<corpus format>-<sha16>-<vocab>.bin/.idx``), so a
different corpus, tokenization or vocabulary never reuses them.

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

from megatron_gift.testing import indexed_data as indexed
from megatron_gift.testing.indexed_data import document_lengths
from megatron_gift_tools.bench.corpus import TokenCorpus, build_token_corpus

__all__ = ["document_lengths", "indexed_prefix", "megatron_data_args", "write_indexed_dataset"]


def indexed_prefix(corpus: TokenCorpus) -> Path:
    """Path prefix of ``corpus``'s indexed dataset: ``<cache>/indexed-<corpus key>``, next to its tokenizer."""
    stem = corpus.tokenizer_path.stem  # bpe-<corpus format>-<sha16>-<vocab>
    key = stem.split("-", 1)[1] if stem.startswith("bpe-") else stem
    return corpus.tokenizer_path.parent / f"indexed-{key}"


def write_indexed_dataset(corpus: TokenCorpus, prefix: str | os.PathLike | None = None, force: bool = False) -> str:
    """Write ``corpus`` as ``<prefix>.bin`` / ``<prefix>.idx`` unless present; return the prefix.

    ``prefix`` defaults to :func:`indexed_prefix` (next to the corpus cache). Token ids are
    stored as ``uint16`` when the vocabulary fits (as Megatron's preprocessing does), else ``int32``.
    """
    prefix = indexed_prefix(corpus) if prefix is None else prefix
    return indexed.write_indexed_dataset(corpus.tokens.numpy(), corpus.vocab_size, corpus.eot_id, prefix, force)


def megatron_data_args(corpus: TokenCorpus, prefix: str | None = None) -> list[str]:
    """Megatron flags that train on ``corpus``'s indexed dataset (built if missing) with ``NullTokenizer``."""
    prefix = write_indexed_dataset(corpus) if prefix is None else prefix
    return indexed.data_args(prefix, corpus.vocab_size, corpus.eot_id)


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
