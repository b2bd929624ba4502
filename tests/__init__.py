"""The test suite imports tridist by its installed names only.

pytest (for the `tests` package) and `python -m` put the repository root on sys.path, where the
folders kernels/, autotune/, distcore/ and bench/ would import as top-level packages: a second copy of
each module beside `tridist.kernels` & co. (torch.library ops registered twice, two distinct classes
for one name), and a shadow over other projects of those names (Hugging Face's `kernels`, which
transformers imports when installed). Every test module and distributed worker imports this package
first, so the guard below is in place before anything else is imported.
"""

from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHADOWED = ("kernels", "autotune", "distcore", "bench")


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
