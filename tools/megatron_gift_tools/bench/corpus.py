"""Offline real-text corpus for the benchmarks: the Python documentation sources.

The text comes from Debian's ``python3-doc`` package (reStructuredText sources of
docs.python.org: English prose mixed with code), so benchmarks run on real language
statistics without network access beyond the Debian mirror. If the documentation is
installed system-wide it is used directly; otherwise the ``.deb`` files are fetched
with ``apt-get download`` and unpacked with ``dpkg-deb -x`` into a cache directory,
without installing anything.

On top of the text, :func:`build_token_corpus` trains a byte-level BPE tokenizer and
tokenizes the whole corpus once. Everything is cached (keyed by the corpus sha256 and
the vocabulary size) and deterministic: documents are read in sorted path order,
BPE training is deterministic, and batches are sampled from a seeded generator.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

EOT = "<|endoftext|>"
"""Special token appended after every document."""

_FORMAT = "v1"  # bump when tokenizer training or tokenization changes, to invalidate caches
_SYSTEM_ROOT = Path("/")
_META_PACKAGE = "python3-doc"


class CorpusUnavailableError(RuntimeError):
    """The Python documentation could neither be found installed nor downloaded."""


def default_cache_dir() -> Path:
    """Cache root: ``$MEGATRON_GIFT_CACHE`` if set, else ``~/.cache/megatron-gift``."""
    env = os.environ.get("MEGATRON_GIFT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "megatron-gift"


def _log(msg: str) -> None:
    print(f"[megatron-gift corpus] {msg}", file=sys.stderr, flush=True)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write via a temporary file and rename, so concurrent readers never see partial files."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _write_json(path: Path, obj: dict) -> None:
    _atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


# --------------------------------------------------------------------------- sources


def _sources_dir(root: Path) -> Path | None:
    """The ``html/_sources`` directory of the Python docs under ``root``, if any.

    Prefers the default version (``usr/share/doc/python3``); otherwise the highest
    versioned directory. Symlinked aliases (``python3.X-doc/html``) are deduplicated.
    """
    doc = root / "usr" / "share" / "doc"
    default = doc / "python3" / "html" / "_sources"
    if default.is_dir():
        return default.resolve()
    found = sorted({p.resolve() for p in doc.glob("python3*/html/_sources") if p.is_dir()})
    return found[-1] if found else None


def _package_for(sources: Path) -> str:
    """Debian package shipping ``.../doc/python3.X/html/_sources``: ``python3.X-doc``."""
    return sources.parent.parent.name + "-doc"


def _run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)


def _installed_versions(packages: list[str]) -> dict[str, str | None]:
    """Versions of installed packages per ``dpkg-query``; ``None`` where unknown."""
    versions: dict[str, str | None] = dict.fromkeys(packages)
    if shutil.which("dpkg-query") is None:
        return versions
    for pkg in packages:
        res = _run(["dpkg-query", "-W", "-f=${Version}", pkg])
        if res.returncode == 0 and res.stdout.strip():
            versions[pkg] = res.stdout.strip()
    return versions


def _apt_download(package: str, dest: Path) -> Path:
    """``apt-get download`` one package into ``dest``; runs ``apt-get update`` once if needed."""
    res = _run(["apt-get", "download", package], cwd=dest)
    if res.returncode != 0:
        _log(f"apt-get download {package} failed; running apt-get update and retrying")
        upd = _run(["apt-get", "update"])
        res = _run(["apt-get", "download", package], cwd=dest)
        if res.returncode != 0:
            raise CorpusUnavailableError(
                f"`apt-get download {package}` failed:\n{res.stderr.strip()}\n"
                f"(apt-get update said: {upd.stderr.strip() or 'ok'})\n"
                "Install the Python documentation (`apt-get install python3-doc`) or make "
                "a Debian mirror reachable."
            )
    debs = list(dest.glob(f"{package}_*.deb"))
    if len(debs) != 1:
        raise CorpusUnavailableError(f"apt-get download {package} left {len(debs)} matching .deb files in {dest}")
    return debs[0]


def _deb_field(deb: Path, field: str) -> str:
    return _run(["dpkg-deb", "-f", str(deb), field]).stdout.strip()


def _download_docs(cache: Path) -> dict[str, str | None]:
    """Fetch and unpack ``python3-doc`` and the versioned docs package it depends on.

    The packages are unpacked in a temporary directory; only their ``html/_sources``
    tree is kept, as ``<cache>/python3-doc/_sources`` (about 12 MB of 80).
    """
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise CorpusUnavailableError(
                f"The Python documentation is not installed and `{tool}` is missing, so it "
                "cannot be downloaded. On Debian/Ubuntu: `apt-get install python3-doc`."
            )
    work = cache / "python3-doc"
    work.mkdir(parents=True, exist_ok=True)
    _log("downloading python3-doc with apt-get download")
    with tempfile.TemporaryDirectory(dir=work, prefix="staging.") as staging:
        debs_dir, tmp_root = Path(staging) / "debs", Path(staging) / "root"
        debs_dir.mkdir()
        meta = _apt_download(_META_PACKAGE, debs_dir)
        # The meta package only holds symlinks; the text is in python3.X-doc, its dependency.
        deps = [d.split()[0] for d in _deb_field(meta, "Depends").split(",") if d.strip()]
        doc_pkgs = [d for d in deps if d.startswith("python3") and d.endswith("-doc")]
        if not doc_pkgs:
            raise CorpusUnavailableError(f"no versioned docs package in {meta.name} Depends: {deps}")
        debs = [meta] + [_apt_download(pkg, debs_dir) for pkg in doc_pkgs]
        versions = {_deb_field(d, "Package"): _deb_field(d, "Version") for d in debs}
        for deb in debs:
            res = _run(["dpkg-deb", "-x", str(deb), str(tmp_root)])
            if res.returncode != 0:
                raise CorpusUnavailableError(f"dpkg-deb -x {deb.name} failed: {res.stderr.strip()}")
        sources = _sources_dir(tmp_root)
        if sources is None:
            raise CorpusUnavailableError(f"no html/_sources directory in {[d.name for d in debs]}")
        shutil.rmtree(work / "_sources", ignore_errors=True)
        os.replace(sources, work / "_sources")
    _write_json(work / "packages.json", versions)  # written last: marks a complete extraction
    return versions


def _locate_docs(cache: Path) -> tuple[Path, str, dict[str, str | None]]:
    """Find the doc sources: installed system-wide, else cached extraction, else download.

    Returns ``(sources_dir, origin, package_versions)``.
    """
    installed = _sources_dir(_SYSTEM_ROOT)
    if installed is not None:
        return installed, "installed", _installed_versions([_META_PACKAGE, _package_for(installed)])
    sources, versions_file = cache / "python3-doc" / "_sources", cache / "python3-doc" / "packages.json"
    if versions_file.is_file() and sources.is_dir():
        versions = json.loads(versions_file.read_text())
    else:
        versions = _download_docs(cache)
    return sources, "apt-get download", versions


def load_documents(cache_dir: str | os.PathLike | None = None) -> tuple[list[str], dict]:
    """Read the documentation sources as a sorted list of documents.

    Returns ``(documents, manifest)``; the manifest (also written to
    ``<cache>/corpus-manifest.json``) records the origin, package versions, file count,
    size and the corpus sha256 (over each document's relative path and bytes, in order).
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    sources, origin, versions = _locate_docs(cache)
    paths = sorted(p for p in sources.rglob("*.txt") if p.is_file())
    if not paths:
        raise CorpusUnavailableError(f"no .txt files under {sources}")
    digest = hashlib.sha256()
    docs = []
    for path in paths:
        data = path.read_bytes()
        digest.update(path.relative_to(sources).as_posix().encode() + b"\0" + data + b"\0")
        docs.append(data.decode("utf-8"))
    manifest = {
        "origin": origin,
        "sources_dir": str(sources),
        "packages": versions,
        "files": len(docs),
        "bytes": sum(p.stat().st_size for p in paths),
        "sha256": digest.hexdigest(),
    }
    manifest_path = cache / "corpus-manifest.json"
    if not manifest_path.is_file() or json.loads(manifest_path.read_text()) != manifest:
        _write_json(manifest_path, manifest)
    return docs, manifest


# --------------------------------------------------------------------------- tokenizer


def _train_tokenizer(docs: list[str], vocab_size: int):
    """Train a deterministic byte-level BPE with an end-of-document special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    return tok


@dataclass
class TokenCorpus:
    """The whole tokenized corpus plus reproducible batch sampling.

    ``tokens`` is a 1-D int32 tensor: every document's tokens followed by the EOT id,
    in sorted document order. The last ``held_out_fraction`` of the tokens (moved
    forward to a document boundary) form the held-out split.
    """

    tokens: torch.Tensor
    vocab_size: int
    tokenizer_path: Path
    manifest: dict
    eot_id: int
    held_out_fraction: float = 0.02

    def split(self, held_out_fraction: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(train, heldout)`` views; held-out starts at the first document after the cut."""
        frac = self.held_out_fraction if held_out_fraction is None else held_out_fraction
        n = self.tokens.numel()
        cut = n - int(round(n * frac))
        ends = torch.nonzero(self.tokens[cut:] == self.eot_id).flatten()
        if ends.numel() and cut + int(ends[0]) + 1 < n:
            cut += int(ends[0]) + 1
        return self.tokens[:cut], self.tokens[cut:]

    def tokenizer(self):
        """The trained ``tokenizers.Tokenizer``."""
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.tokenizer_path))

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return self.tokenizer().decode(ids, skip_special_tokens=False)

    def batches(
        self, seq_len: int, batch_size: int, seed: int = 0, split: str = "train"
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless ``(input, target)`` int64 pairs of shape ``[batch_size, seq_len]``.

        Windows start at uniformly random offsets of the chosen split (``'train'`` or
        ``'heldout'``), drawn from a generator seeded with ``seed``; the target is the
        input shifted by one token. The same arguments always give the same stream.
        """
        train, heldout = self.split()
        data = {"train": train, "heldout": heldout}[split]
        n_starts = data.numel() - seq_len
        if n_starts < 1:
            raise ValueError(f"{split} split has {data.numel()} tokens, too few for seq_len={seq_len}")
        gen = torch.Generator().manual_seed(seed)
        offsets = torch.arange(seq_len + 1)
        while True:
            starts = torch.randint(0, n_starts, (batch_size, 1), generator=gen)
            window = data[starts + offsets].long()
            yield window[:, :-1], window[:, 1:]


def build_token_corpus(vocab_size: int = 8192, cache_dir: str | os.PathLike | None = None) -> TokenCorpus:
    """Load (building and caching on first use) the tokenized Python-docs corpus.

    Cached under ``cache_dir`` (default :func:`default_cache_dir`): the tokenizer as
    ``bpe-<fmt>-<sha16>-<vocab>.json`` and the tokens as ``tokens-<fmt>-<sha16>-<vocab>.npy``,
    keyed by the corpus sha256, so a different documentation version never reuses them.
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be at least 257 (256 bytes + EOT), got {vocab_size}")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    docs, manifest = load_documents(cache)
    key = f"{_FORMAT}-{manifest['sha256'][:16]}-{vocab_size}"
    tok_path = cache / f"bpe-{key}.json"
    tokens_path = cache / f"tokens-{key}.npy"

    if tok_path.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_path))
    else:
        _log(f"training byte-level BPE (vocab {vocab_size}) on {manifest['bytes'] / 1e6:.1f} MB of text")
        t = time.perf_counter()
        tok = _train_tokenizer(docs, vocab_size)
        _atomic_write_bytes(tok_path, tok.to_str().encode())
        _log(f"trained in {time.perf_counter() - t:.1f}s -> {tok_path}")
    eot_id = tok.token_to_id(EOT)

    if tokens_path.is_file():
        ids = np.load(tokens_path)
    else:
        _log(f"tokenizing {len(docs)} documents")
        t = time.perf_counter()
        pieces = []
        for enc in tok.encode_batch(docs):
            pieces.append(np.asarray(enc.ids, dtype=np.int32))
            pieces.append(np.asarray([eot_id], dtype=np.int32))
        ids = np.concatenate(pieces)
        buf = io.BytesIO()
        np.save(buf, ids)
        _atomic_write_bytes(tokens_path, buf.getvalue())
        _log(f"tokenized {ids.size:,} tokens in {time.perf_counter() - t:.1f}s -> {tokens_path}")

    info = dict(
        manifest,
        vocab_size=vocab_size,
        num_tokens=int(ids.size),
        tokens_sha256=hashlib.sha256(ids.tobytes()).hexdigest(),
    )
    return TokenCorpus(
        tokens=torch.from_numpy(ids),
        vocab_size=vocab_size,
        tokenizer_path=tok_path,
        manifest=info,
        eot_id=eot_id,
    )
