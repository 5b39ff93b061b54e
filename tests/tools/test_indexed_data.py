"""The tools' corpus as a Megatron indexed dataset (``bench.indexed_data``): named after the corpus cache
key, written through ``megatron_gift.testing.indexed_data``, with the flags that train on it (moved from
tests/megatron/test_launcher.py)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from megatron_gift_tools.bench.corpus import TokenCorpus
from megatron_gift_tools.bench.indexed_data import megatron_data_args, write_indexed_dataset


def _synthetic_corpus(tmp_path: Path) -> TokenCorpus:
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 300, size=n).astype(np.int32) for n in (5, 1, 17, 3)]
    tokens = np.concatenate([np.append(d, 0) for d in docs]).astype(np.int32)
    return TokenCorpus(
        tokens=torch.from_numpy(tokens),
        vocab_size=300,
        tokenizer_path=tmp_path / "bpe-v1-0123456789abcdef-300.json",
        manifest={},
        eot_id=0,
    )


def test_indexed_dataset_one_document_per_eot(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    corpus = _synthetic_corpus(tmp_path)
    prefix = write_indexed_dataset(corpus)
    assert prefix == str(tmp_path / "indexed-v1-0123456789abcdef-300")
    ds = IndexedDataset(prefix)
    assert len(ds) == 4 and list(ds.document_indices) == [0, 1, 2, 3, 4]
    assert [len(ds[i]) for i in range(4)] == [6, 2, 18, 4]
    assert all(ds[i][-1] == 0 and (ds[i][:-1] != 0).all() for i in range(4))
    assert np.array_equal(np.concatenate([ds[i] for i in range(4)]), corpus.tokens.numpy())
    assert ds.index.dtype == np.uint16  # Megatron's choice for a vocabulary this small

    mtime = os.stat(prefix + ".bin").st_mtime_ns
    assert write_indexed_dataset(corpus) == prefix and os.stat(prefix + ".bin").st_mtime_ns == mtime  # cached
    assert megatron_data_args(corpus, prefix) == [
        "--data-path",
        prefix,
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "300",
        "--null-tokenizer-eod-id",
        "0",
    ]
    assert not list(tmp_path.glob("*.tmp*"))
