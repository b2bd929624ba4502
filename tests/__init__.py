"""The test suite imports tridist by its installed names only.

pytest (for the `tests` package) and `python -m` put the repository root on sys.path, where the
folders kernels/, autotune/, distcore/ and bench/ would import as top-level packages: a second copy of
each module beside `tridist.kernels` & co. (torch.library ops registered twice, two distinct classes
for one name), and a shadow over other projects of those names (Hugging Face's `kernels`, which
transformers imports when installed). Every test module and distributed worker imports this package
first, so the guard below is in place before anything else is imported.
"""

from __future__ import annotations

import gc
import importlib.machinery
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHADOWED = ("kernels", "autotune", "distcore", "bench")


# The collector's thresholds once the imports are frozen. Python's defaults (700, 10, 10) run a young collection
# every 700 net allocations of containers; a training step through DTensor and FSDP2 allocates hundreds of
# thousands of short-lived ones (specs, pytrees, fake tensors), almost all freed by reference counting, so those
# collections find little. Measured on a 4-process transformers check: 5-8% less CPU (paired runs). The test
# processes' garbage in cycles is small (tiny models), so collecting it 70x less often costs little memory.
GC_THRESHOLDS = (50_000, 50, 100)


def settle_garbage_collector() -> None:
    """Once a test process has imported what it lives with (torch, transformers: ~400,000 objects, kept until
    exit): collect once, freeze the survivors so that no later collection scans them (6% of a transformers
    check's CPU time), and collect the rest at GC_THRESHOLDS. Turns the collector on (the imports ran with it
    paused: tests/conftest.py, tests/distributed/__init__.py)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    gc.enable()


class _RootFinder(importlib.machinery.FileFinder):
    """The repository root's finder, minus kernels/autotune/distcore/bench: for the import system those
    folders do not exist (`import kernels` is the ordinary ModuleNotFoundError, and
    `importlib.util.find_spec("kernels")` is None, which is how transformers asks whether Hugging Face's
    `kernels` package is installed). Another project's package of that name, elsewhere on sys.path,
    still imports."""

    def find_spec(self, fullname, target=None):
        if fullname in SHADOWED:
            return None
        return super().find_spec(fullname, target)


def _root_hook(path: str):
    if Path(path or ".").resolve() != ROOT:
        raise ImportError("not the repository root")  # the next path hook handles it
    loaders = [
        (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES),
        (importlib.machinery.SourceFileLoader, importlib.machinery.SOURCE_SUFFIXES),
        (importlib.machinery.SourcelessFileLoader, importlib.machinery.BYTECODE_SUFFIXES),
    ]  # FileFinder's standard loaders, in its own order
    return _RootFinder(path, *loaders)


if not any(getattr(h, "__name__", "") == "_root_hook" for h in sys.path_hooks):
    sys.path_hooks.insert(0, _root_hook)
    for entry in list(sys.path_importer_cache):  # finders cached before the hook
        if Path(entry or ".").resolve() == ROOT:
            del sys.path_importer_cache[entry]
