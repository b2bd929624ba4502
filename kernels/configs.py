"""Launch configurations: a tuned per-device table when one exists, each op's documented heuristic otherwise.

`autotune` sweeps configurations with Optuna and writes the winners here as a small JSON table per
device; this module only reads it (kernels/ imports nothing else of ours). The table lives at
`$TRIDIST_KERNEL_CONFIGS` if set, else `~/.cache/tridist/kernel-configs/<device-slug>.json`:

    {"device": "NVIDIA H100 80GB HBM3", "triton": "3.4.0",
     "configs": {"rms_norm_fwd": {"dtype=bfloat16,n_cols=4096": {"BLOCK_N": 4096, "BLOCK_M": 1, "num_warps": 8}}}}

Keys are built by `config_key`. An entry that does not name exactly the op's parameters, or whose
values are not positive powers of two, is ignored with a warning, so a stale table never breaks a
launch.
"""

from __future__ import annotations

import functools
import json
import os
import re
import warnings
from pathlib import Path

import torch


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def device_slug(device: torch.device) -> str:
    """A file-name-safe name of the device model, e.g. 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")


def tuned_table_path(device: torch.device) -> Path:
    override = os.environ.get("TRIDIST_KERNEL_CONFIGS")
    if override:
        return Path(override)
    return Path.home() / ".cache" / "tridist" / "kernel-configs" / f"{device_slug(device)}.json"


def config_key(**features) -> str:
    """The lookup key of a launch: sorted `name=value` pairs (dtypes by their short name)."""
    parts = []
    for name in sorted(features):
        value = features[name]
        if isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        parts.append(f"{name}={value}")
    return ",".join(parts)


@functools.lru_cache(maxsize=None)
def _load_table(path: str) -> dict:
    try:
        with open(path) as f:
            table = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as error:
        warnings.warn(f"tridist: ignoring unreadable kernel config table {path}: {error}", stacklevel=3)
        return {}
    return table.get("configs", {})


def clear_cache() -> None:
    """Forget tables already read (after autotune wrote a new one in this process)."""
    _load_table.cache_clear()
    tuned_config.cache_clear()


@functools.lru_cache(maxsize=4096)
def tuned_config(op: str, device: torch.device, key: str, allowed: frozenset[str]) -> dict | None:
    """The tuned configuration of `op` for `key` on this device, or None.

    Cached: launches ask on every call, and finding the table queries the device's name.
    Callers must not modify the returned dict.
    """
    entry = _load_table(str(tuned_table_path(device))).get(op, {}).get(key)
    if entry is None:
        return None
    problem = None
    if set(entry) != allowed:
        unknown, missing = sorted(set(entry) - allowed), sorted(allowed - set(entry))
        problem = f"names unknown parameters {unknown} / lacks {missing} (expected exactly {sorted(allowed)})"
    elif not all(isinstance(v, int) and v > 0 and v & (v - 1) == 0 for v in entry.values()):
        problem = f"has values that are not positive powers of two: {entry}"
    if problem:
        warnings.warn(
            f"tridist: tuned config for {op} [{key}] {problem}; using the heuristic instead. "
            "Re-run the kernel sweep.",
            stacklevel=3,
        )
        return None
    return entry
