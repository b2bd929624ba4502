"""Launch configurations: a tuned per-device table when one exists, each op's documented heuristic otherwise.

`tridist autotune kernels` (autotune/kernel_sweep.py) times configurations with Optuna and writes the
winners here as a small JSON table per device; this module only reads it (kernels/ imports nothing
else of ours). The table lives at `$TRIDIST_KERNEL_CONFIGS` if set, else
`~/.cache/tridist/kernel-configs/<device-slug>.json`:

    {"format": 2, "device": "NVIDIA H100 80GB HBM3", "torch": "2.13.0", "triton": "3.8.0",
     "kernels": {"rms_norm_fwd": {"version": "<hash of the kernel's source>",
                                  "entries": {"dtype=bfloat16,n_cols=4096,rows=16384":
                                              {"config": {"BLOCK_M": 1, "BLOCK_N": 4096, "num_warps": 8},
                                               "tuned_ms": 0.041, "heuristic_ms": 0.047, "gain": 1.15, ...}}}}}

Each kernel is a `Tunable`: its table name, the launch parameters it exposes and the Triton functions
whose source is its version. Entries are keyed by shape *buckets* (`config_key` of `width_bucket`,
`rows_bucket`, dtype, ...), so one tuned entry serves every shape of its bucket. The heuristic is used
instead, with one warning saying why, when the table was written on another device or under other
torch/Triton versions, when the kernel's source changed since (its version differs), or when an
entry does not name exactly the kernel's parameters as positive powers of two: a stale table never
breaks a launch, and a bucket the sweep never saw simply gets the heuristic.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import os
import re
import warnings
from pathlib import Path

import torch

TABLE_FORMAT = 2
# Launch limits a table entry must respect (a hand-edited table must not break a launch): 32 warps is
# CUDA's 1024 threads per block; no kernel here tiles more than 2**16 elements along one parameter.
MAX_NUM_WARPS = 32
MAX_CONFIG_VALUE = 1 << 16

# Row-count buckets: powers of four from 1024 to 65536 rows. Below ~1024 rows a launch is a single
# wave of programs on any GPU of this class (132 SMs) and the config hardly matters; above 65536 the
# grid is many waves long and the best tile no longer depends on the count. A bucket is named by its
# upper bound: rows=16384 holds 4097..16384 rows.
ROWS_BUCKET_MIN, ROWS_BUCKET_MAX = 1024, 65536


def rows_bucket(n_rows: int) -> int:
    bucket = ROWS_BUCKET_MIN
    while bucket < n_rows and bucket < ROWS_BUCKET_MAX:
        bucket *= 4
    return bucket


def width_bucket(n_cols: int) -> int:
    """The next power of two: tile widths are powers of two, so every width of a bucket gets the same tiles."""
    return 1 << max(0, int(n_cols) - 1).bit_length()


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: launches look it up on every call
class Tunable:
    """One kernel as the sweep and the table see it (e.g. `rms_norm_fwd`, `rotary_bwd`)."""

    name: str
    params: frozenset[str]
    sources: tuple  # the @triton.jit functions (and helpers) the launch runs: their source is the version

    @functools.cached_property
    def version(self) -> str:
        """A hash of the kernels' source: a table tuned for other code is stale."""
        digest = hashlib.sha1()
        for fn in self.sources:
            digest.update(inspect.getsource(getattr(fn, "fn", fn)).encode())
        return digest.hexdigest()[:16]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def device_slug(device: torch.device) -> str:
    """A file-name-safe name of the device model, e.g. 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")


def tuned_table_path(device: torch.device) -> Path:
    """Where the tuned table of `device` is: $TRIDIST_KERNEL_CONFIGS, else the user's cache. Launch plans are
    cached, so a change of the variable after the first launch takes effect after clear_cache()."""
    override = os.environ.get("TRIDIST_KERNEL_CONFIGS")
    if override:
        return Path(override)
    return Path.home() / ".cache" / "tridist" / "kernel-configs" / f"{device_slug(device)}.json"


def software_versions() -> dict:
    """What a table is tuned under besides the device and the kernels' own source."""
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__}


def config_key(**features) -> str:
    """The lookup key of a launch: sorted `name=value` pairs (dtypes by their short name)."""
    parts = []
    for name in sorted(features):
        value = features[name]
        if isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        parts.append(f"{name}={value}")
    return ",".join(parts)


@functools.lru_cache(maxsize=4096)  # pure, and asked on every launch
def row_tuning_key(n_rows: int, n_cols: int, dtype: torch.dtype) -> str:
    """The table bucket of a launch over `n_rows` rows of `n_cols` (RMSNorm, SwiGLU; the sweep writes under it)."""
    return config_key(n_cols=width_bucket(n_cols), rows=rows_bucket(n_rows), dtype=dtype)


def _warn(message: str) -> None:
    warnings.warn(f"tridist: {message}; the launch heuristics are used instead. Re-run `tridist autotune kernels`.",
                  stacklevel=4)


@functools.lru_cache(maxsize=None)
def _load_table(path: str, device: str) -> dict:
    """The table's kernels section, or {} (with one warning) when it is missing, unreadable or stale."""
    try:
        with open(path) as f:
            table = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as error:
        _warn(f"ignoring unreadable kernel config table {path}: {error}")
        return {}
    if not isinstance(table, dict) or table.get("format") != TABLE_FORMAT:
        _warn(f"ignoring kernel config table {path}: format {table.get('format') if isinstance(table, dict) else '?'}, "
              f"expected {TABLE_FORMAT}")
        return {}
    if table.get("device") != device:
        _warn(f"ignoring kernel config table {path}: tuned on {table.get('device')!r}, this is {device!r}")
        return {}
    stale = {name: (table.get(name), now) for name, now in software_versions().items() if table.get(name) != now}
    if stale:
        what = ", ".join(f"{name} {was} (now {now})" for name, (was, now) in stale.items())
        _warn(f"ignoring kernel config table {path}: tuned under {what}")
        return {}
    return table.get("kernels", {})


@functools.lru_cache(maxsize=None)
def _kernel_entries(path: str, device: str, tunable: Tunable) -> dict:
    section = _load_table(path, device).get(tunable.name)
    if section is None:
        return {}
    if section.get("version") != tunable.version:
        _warn(f"ignoring the tuned configs of {tunable.name} in {path}: tuned for kernel version "
              f"{section.get('version')}, the kernel's source is now {tunable.version}")
        return {}
    return section.get("entries", {})


def clear_cache() -> None:
    """Forget tables already read and the launch plans made from them (after autotune wrote a new table in this
    process, or TRIDIST_KERNEL_CONFIGS changed)."""
    _load_table.cache_clear()
    _kernel_entries.cache_clear()
    tuned_config.cache_clear()
    for plans in _LAUNCH_PLAN_CACHES:
        plans.cache_clear()


_LAUNCH_PLAN_CACHES = []  # filled at import by the ops' @launch_plan functions, never after


def launch_plan(build):
    """Cache an op's launch plan: a pure function of its inputs' shapes, strides, dtypes and device (and the
    tuned table, so clear_cache() forgets the plans too). A launch then costs one lookup instead of working
    out its configuration, grid and strides again (~10 us of host time per call, as long as the kernel
    runs at common shapes). `build.__wrapped__` builds one uncached (a sweep's candidate configuration)."""
    cached = functools.lru_cache(maxsize=4096)(build)
    _LAUNCH_PLAN_CACHES.append(cached)
    return cached


def check_config(tunable: Tunable, config: dict) -> str | None:
    """Why `config` cannot launch `tunable` (unknown or missing parameters, not powers of two), or None."""
    if not isinstance(config, dict) or set(config) != tunable.params:
        names = set(config) if isinstance(config, dict) else set()
        unknown, missing = sorted(names - tunable.params), sorted(tunable.params - names)
        return f"names unknown parameters {unknown} / lacks {missing} (expected exactly {sorted(tunable.params)})"
    if not all(isinstance(v, int) and v > 0 and v & (v - 1) == 0 for v in config.values()):
        return f"has values that are not positive powers of two: {config}"  # tl.arange needs 2**k
    if config.get("num_warps", 1) > MAX_NUM_WARPS or any(v > MAX_CONFIG_VALUE for v in config.values()):
        return f"has values out of range (num_warps <= {MAX_NUM_WARPS}, others <= {MAX_CONFIG_VALUE}): {config}"
    return None


@functools.lru_cache(maxsize=4096)
def tuned_config(tunable: Tunable, device: torch.device, key: str) -> dict | None:
    """The tuned configuration of `tunable` for the bucket `key` on this device, or None.

    Cached: launches ask on every call, and finding the table queries the device's name.
    Callers must not modify the returned dict.
    """
    path = str(tuned_table_path(device))
    entry = _kernel_entries(path, device_name(device), tunable).get(key)
    if entry is None:
        return None
    config = entry.get("config") if isinstance(entry, dict) else None
    problem = check_config(tunable, config)
    if problem:
        _warn(f"the tuned config for {tunable.name} [{key}] in {path} {problem}")
        return None
    return config
