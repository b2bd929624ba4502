"""The test suite imports tridist by its installed names only.

pytest (for the `tests` package) and `python -m` put the repository root on sys.path, where the
folders kernels/, autotune/, distcore/ and bench/ would import as top-level packages: a second copy of
each module beside `tridist.kernels` & co. (torch.library ops registered twice, two distinct classes
for one name), and a shadow over other projects of those names (Hugging Face's `kernels`, which
transformers imports when installed). Every test module and distributed worker imports this package
first, so the guard below is in place before anything else is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHADOWED = ("kernels", "autotune", "distcore", "bench")


class _RefusedLoader(importlib.abc.Loader):
    def create_module(self, spec):
        raise ImportError(
            f"{spec.name!r} is tridist's repository folder {spec.name}/, not a top-level package: import "
            f"'tridist.{spec.name}' (tests must use the installed names; see tests/__init__.py)",
            name=spec.name,
        )

    def exec_module(self, module):  # pragma: no cover - create_module always raises
        raise AssertionError("unreachable")


class RepositoryRootGuard(importlib.abc.MetaPathFinder):
    """Resolves kernels/autotune/distcore/bench as if the repository root were not on sys.path: another
    project's package of that name still imports; the repository's folder is refused with the fix."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in SHADOWED:
            return None
        elsewhere = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT]
        spec = importlib.machinery.PathFinder.find_spec(fullname, elsewhere)
        if spec is not None:
            return spec
        if importlib.machinery.PathFinder.find_spec(fullname, [str(ROOT)]) is None:
            return None  # not ours either: the ordinary "No module named ..."
        return importlib.machinery.ModuleSpec(fullname, _RefusedLoader())


if not any(isinstance(finder, RepositoryRootGuard) for finder in sys.meta_path):
    sys.meta_path.insert(0, RepositoryRootGuard())
