"""The distribution installs one import name, `tridist`, and nothing else at the top level.

kernels/, autotune/, distcore/ and bench/ sit at the repository root but install as subpackages of
`tridist` (pyproject's package-dir mapping): top-level `kernels` is Hugging Face's kernel hub,
`bench` and `autotune` are other PyPI projects, and installing ours under those names would clobber them.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tests import ROOT, SHADOWED

SUBPACKAGE_DIRS = ("kernels", "autotune", "distcore", "bench")


def _tree_packages() -> set[str]:
    """Every package the repository holds, by its installed name."""
    names = {"tridist"}
    for folder in SUBPACKAGE_DIRS:
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT).parts
            names.add(".".join(("tridist", *parts)))
    return names


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the sources (the build writes build/ and *.egg-info beside them)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "results")
    for folder in ("src", *SUBPACKAGE_DIRS):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                    "--disable-pip-version-check", "-w", str(out), str(src)], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("tridist-*.whl")
    return built


def test_wheel_has_one_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert top - dist_info == {"tridist"}, sorted(top)
    (info,) = dist_info
    top_level = [n for n in names if n == f"{info}/top_level.txt"]
    if top_level:  # setuptools writes it; older ones did not
        assert zipfile.ZipFile(wheel).read(top_level[0]).decode().split() == ["tridist"]


def test_wheel_holds_every_package_of_the_tree(wheel):
    packaged = {
        ".".join(Path(name).parent.parts)
        for name in zipfile.ZipFile(wheel).namelist()
        if name.endswith("/__init__.py")
    }
    assert packaged == _tree_packages(), "pyproject's [tool.setuptools] packages list is out of date"


def _running_site_packages() -> list[str]:
    """Where this interpreter finds its installed packages (torch, triton): its environment's
    site-packages (a virtualenv's, or the system's, or both for a venv with system site packages) and
    the user's, when the interpreter reads it."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if os.path.isdir(d)]


def test_installed_wheel_imports_from_anywhere(wheel, tmp_path):
    """Install the wheel in a fresh virtualenv and use it from a directory that is not the repository:
    the entry points, the console script, the torch.library ops.

    torch comes from the running interpreter's site-packages, listed in a .pth file of the new
    environment. Not `system_site_packages=True`: inside a virtualenv the "system" packages are the
    base interpreter's, which has no torch. A .pth line that names a directory only adds it to
    sys.path; the .pth files in that directory are not run, so the editable install's finder
    (`__editable__*tridist*.pth`) stays out and every tridist module must come from the wheel (asserted
    below)."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--quiet",
                    "--disable-pip-version-check", str(wheel)], check=True, capture_output=True, timeout=300)
    # After the install: pip must neither see the running environment's tridist (the editable one) as
    # already installed nor touch it.
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    (Path(purelib) / "running_interpreter.pth").write_text("\n".join(_running_site_packages()) + "\n")
    code = (
        "import pathlib, sys, tridist\n"
        "assert 'torch' not in sys.modules, 'import tridist must stay light'\n"
        "import tridist.kernels, tridist.distcore, tridist.autotune, tridist.bench.cli\n"
        f"root = pathlib.Path({str(env_dir)!r})\n"
        "for m in (tridist, tridist.kernels, tridist.distcore, tridist.autotune, tridist.bench):\n"
        "    assert root in pathlib.Path(m.__file__).parents, m.__file__\n"
        "import torch\n"
        "assert hasattr(torch.ops.tridist, 'rms_norm')\n"
        "assert tridist.fuse is tridist.kernels.fuse and tridist.to_distributed is tridist.distcore.to_distributed\n"
        "import importlib.util\n"
        f"shadowed = [n for n in {SHADOWED!r} if (s := importlib.util.find_spec(n)) and root in pathlib.Path(s.origin or '').parents]\n"
        "assert not shadowed, shadowed\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    run = subprocess.run([str(python), "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    script = env_dir / "bin" / "tridist"
    run = subprocess.run([str(script), "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "tridist" in run.stdout, run.stderr[-2000:]


def test_unknown_attribute_names_the_public_ones():
    import tridist

    with pytest.raises(AttributeError, match="no attribute 'fusee'.*fuse"):
        tridist.fusee  # noqa: B018


@pytest.mark.parametrize("name", SHADOWED)
def test_repository_folders_are_not_top_level_packages(name):
    """pytest puts the repository root on sys.path; tests/__init__.py keeps its folders from importing as
    a second copy of tridist's subpackages (another project's package of that name still imports)."""
    spec = importlib.util.find_spec(name)  # transformers asks this way whether HF's `kernels` is installed
    assert spec is None or ROOT not in Path(spec.origin or "/").resolve().parents, spec
    try:
        module = __import__(name)
    except ModuleNotFoundError as exc:
        assert "No module named" in str(exc)
    else:
        assert ROOT not in Path(module.__file__).resolve().parents, module.__file__
    assert not [m for m in sys.modules if m == name or m.startswith(f"{name}.")
                if ROOT in Path(getattr(sys.modules[m], "__file__", None) or "/").resolve().parents]
