"""Every iteration of the real launcher (2 gloo ranks, ``--gift-cpu``) under the host-sync sanitizer
(``testing.sync_probe``): forward, backward, ``finish_grad_sync``, optimizer step, the delta parameter
gather, Megatron's ``training_log`` and the plugin's step close. A steady iteration makes no host
synchronisation in the plugin; refresh, telemetry and first iterations make only their stated ones."""

import json
import os

import pytest

from megatron_gift.testing.indexed_data import synthetic_data_args
from megatron_gift.testing.launch import run_launcher
from megatron_gift.testing.sync_probe import ENV
from tests.launches import FLAGS

ITERS, INTERVAL = 8, 4  # refresh and telemetry interval
GIFT = [
    "--gift-mode",
    "gift",
    "--gift-rank",
    "8",
    "--gift-sketch",
    "16",
    "--gift-refresh-interval",
    str(INTERVAL),
    "--gift-log-interval",
    str(INTERVAL),
    "--gift-param-gather",
    "delta",
    "--overlap-param-gather",
]


def _flags(**values) -> list[str]:
    out = list(FLAGS)
    for flag in ("--save-interval",):
        i = out.index(flag)
        del out[i : i + 2]
    for flag, value in values.items():
        out[out.index(flag) + 1] = str(value)
    return out


def _refresh(step: int) -> bool:
    """``GiftState.is_refresh_step`` at this interval (step = iteration - 1)."""
    return step >= 0 and (step % INTERVAL == 0 or (step < INTERVAL and step & (step - 1) == 0))


def _budget(iteration: int) -> dict[str, int]:
    """The plugin's host synchronisations an iteration may make, by site (file and op) and count:
    the refresh's three waits on events recorded well before (``refresh_sync``: one in the refresh
    step, two at the start of the next); on telemetry steps one read per bucket group of its profile
    and log sums (``monitor``), and at the next step's start its record's loss; every
    ``--log-interval`` steps the delta gather's replica check (``param_delta``: one read of the
    compared checksums per bucket group)."""
    step = iteration - 1
    waits = int(_refresh(step)) + 2 * int(_refresh(step - 1))
    budget = {"megatron_gift/refresh_sync.py (HostCopy.wait)": waits}
    if step % INTERVAL == 0:
        budget["megatron_gift/megatron/monitor.py (cpu)"] = budget["megatron_gift/megatron/monitor.py (tolist)"] = 1
        budget["megatron_gift/comm/param_delta.py (_local_scalar_dense)"] = 1
    if step >= 1 and (step - 1) % INTERVAL == 0:  # the previous step's telemetry record, closed here: its loss
        budget["megatron_gift/megatron/monitor.py (_local_scalar_dense)"] = 1
    return {k: v for k, v in budget.items() if v}


def _by_site(events: dict[str, int]) -> dict[str, int]:
    """``"file:line (op)"`` counts summed per ``"file (op)"`` (lines move with edits)."""
    out: dict[str, int] = {}
    for key, n in events.items():
        where, op = key.split(" ", 1)
        site = f"{where.rsplit(':', 1)[0]} {op}"
        out[site] = out.get(site, 0) + n
    return out


@pytest.mark.cpu_harness
def test_launcher_iterations_make_only_their_stated_host_syncs(tmp_path, monkeypatch):
    """A per-iteration ``float(loss)`` in the launcher's logging hook, a pageable copy of the codec's
    group lengths on a profile step, or any ``.item()`` / ``.tolist()`` on the steady path stops the
    host every step on a GPU; the sanitizer sees each of them on a CPU run. The first two iterations
    may also build layouts' plans on their first use (host tensors made before the probe started,
    read once; the refresh installs GIFT's transforms at the second)."""
    monkeypatch.setenv(ENV, str(tmp_path / "probe"))
    data = synthetic_data_args(tmp_path / "data")
    flags = _flags(**{"--train-iters": ITERS, "--log-interval": INTERVAL})
    run_launcher(
        2,
        *flags,
        *data,
        "--data-cache-path",
        str(tmp_path / "cache"),
        *GIFT,
        "--gift-telemetry-dir",
        str(tmp_path / "telemetry"),
    )
    plans = ("megatron_gift/comm/layout.py", "megatron_gift/comm/packing.py", "megatron_gift/kernels/placement.py")
    for rank in range(2):
        iterations = json.loads((tmp_path / "probe" / f"rank{rank}.json").read_text())
        assert sorted(map(int, iterations)) == list(range(1, ITERS + 1)), iterations.keys()
        for it, events in iterations.items():
            sites = _by_site(events)
            if it in ("1", "2"):  # first uses of the layouts' plans (GIFT's whitened ones after the first refresh)
                sites = {k: v for k, v in sites.items() if not k.startswith(plans)}
            assert sites == _budget(int(it)), (rank, it, events)
    assert os.listdir(tmp_path / "telemetry")  # the telemetry steps did log
