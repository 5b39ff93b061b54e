"""``bench launches``' launcher records: the ATen ops dispatched from the plugin's frames in a
steady training step of the real launcher (``megatron_gift.pretrain_gpt --gift-cpu``, 2 gloo ranks,
``testing.launch_ops``), at ~0.43M and ~1.67M parameters.

Model: the demo's Llama-style flags (RMSNorm, SwiGLU, RoPE, no biases, untied embeddings, the
distributed optimizer, ``--overlap-grad-reduce``) on Megatron's mock data with the NullTokenizer
(vocabulary 2048); ``--gift-mode gift --gift-euclidean-layers '.*'`` (linear weights GIFT, the rest
Euclidean FP8). Steps 6 and 7 (0-based) are counted: no refresh (the default interval's early
refreshes are steps 0, 1, 2, 4 and 8) and no refresh's install (the step after one), no plugin
logging. ``parameters``: the buckets' elements
Megatron logs. The target: the same count at both sizes (within 10%), the work per bucket not
growing with its elements.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_gift.testing.launch import ENV, ROOT

MODELS = {  # hidden, layers, ffn: 2·V·h + L·(4h² + 3h·ffn + 2h) + h parameters
    "0.43M": (64, 2, 352),
    "1.67M": (128, 4, 576),
}
STEPS = (6, 7)
BUCKET_RE = re.compile(r"Params for bucket (\d+) \((\d+) elements")


def _command(out_dir: str, hidden: int, layers: int, ffn: int) -> list[str]:
    model = [
        "--num-layers",
        str(layers),
        "--hidden-size",
        str(hidden),
        "--num-attention-heads",
        "4",
        "--ffn-hidden-size",
        str(ffn),
        "--seq-length",
        "64",
        "--max-position-embeddings",
        "64",
        "--normalization",
        "RMSNorm",
        "--swiglu",
        "--position-embedding-type",
        "rope",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--train-iters",
        str(max(STEPS) + 1),
        "--lr",
        "1e-3",
        "--min-lr",
        "1e-4",
        "--lr-decay-style",
        "cosine",
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
        "--eval-interval",
        "100000",
        "--split",
        "98,2,0",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "2048",
        "--gift-mode",
        "gift",
        "--gift-euclidean-layers",
        ".*",
    ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "megatron_gift_tools.launch_ops",
        out_dir,
        ",".join(map(str, STEPS)),
        "--",
        "--gift-cpu",
        *model,
    ]


def count(name: str, timeout: float = 900.0) -> dict:
    """One launcher run of model ``name``: its plugin ops per steady step (the most over ranks and steps)."""
    hidden, layers, ffn = MODELS[name]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        res = subprocess.run(
            _command(tmp, hidden, layers, ffn),
            cwd=ROOT,
            env={**os.environ, **ENV},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        log = res.stdout + res.stderr
        if res.returncode != 0:
            raise RuntimeError(f"launcher failed ({res.returncode}):\n{log[-4000:]}")
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    params = sum(int(n) for _, n in dict(BUCKET_RE.findall(log)).items())
    per = {f"rank{r}/step{s}": v["plugin_ops"] for r, res_r in enumerate(ranks) for s, v in res_r.items()}
    return dict(
        kind="launcher",
        path="launcher",
        model=name,
        hidden=hidden,
        layers=layers,
        ffn=ffn,
        parameters=params,
        dp=2,
        mode="gift",
        plugin_ops=max(per.values()),
        per_rank_step=per,
        all_ops=max(v["all_ops"] for r in ranks for v in r.values()),
        top_ops=ranks[0][str(STEPS[0])]["by_op"],
        seconds=round(time.monotonic() - t0, 1),
    )


def launcher_records(quick: bool) -> list[dict]:
    out = []
    for name in ("0.43M",) if quick else tuple(MODELS):
        print(f"[bench launches] launcher, {name} parameters, 2 ranks ...", file=sys.stderr, flush=True)
        out.append(count(name))
    if len(out) == 2:
        out[1]["ratio_to_smaller"] = round(out[1]["plugin_ops"] / out[0]["plugin_ops"], 3)
    return out
