"""What each public import loads, in one fresh interpreter (outside the repository: the installed package):
tridist's packages import in order of weight, and after each step the heavy modules loaded so far are
recorded. A step's promise is that none of the modules it must not pull is loaded after it; sys.modules only
grows, so that also holds before it and the earlier, lighter steps cannot hide what this one pulls. (One
interpreter instead of one per promise: each costs a torch import.)"""

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "optuna", "pandas", "matplotlib", "torch.distributed.pipelining", "torch._dynamo")
STEPS = {  # step: its import, in order
    "tridist": "import tridist",
    "tridist.autotune": "import tridist.autotune",
    "tridist.bench.cli": "import tridist.bench.cli",
    "tridist.kernels": "import tridist.kernels",
    "tridist.bench.model_bench": "import tridist.bench.model_bench",
    "tridist.distcore": "from tridist.distcore import to_distributed, parallelize",
    "distcore.SplitPoint": "from tridist.distcore import SplitPoint",
}
NOT_PULLED = {  # step: what it must not load
    "tridist": {"torch", "optuna", "pandas", "matplotlib"},  # the top level is names only
    "tridist.autotune": {"torch", "optuna", "pandas", "matplotlib"},  # the cost model is plain Python; Optuna loads to search
    "tridist.bench.cli": {"pandas", "matplotlib"},  # reports load them when written
    "tridist.kernels": {"optuna", "pandas", "matplotlib"},
    "tridist.bench.model_bench": {"pandas", "matplotlib"},
    # Pipeline stages (torch.distributed.pipelining, which imports torch._dynamo: ~0.9 s) load when used.
    "tridist.distcore": {"torch.distributed.pipelining", "torch._dynamo"},
}

_DRIVER = r"""
import json, sys
steps, heavy = json.loads(sys.argv[1]), json.loads(sys.argv[2])
loaded = {}
for step, statement in steps.items():
    exec(statement)
    loaded[step] = [name for name in heavy if name in sys.modules]
import tridist
from tridist.kernels import fuse
loaded["reexports"] = (tridist.fuse is fuse and tridist.to_distributed is to_distributed and tridist.parallelize is parallelize
                       and {"kernels", "distcore", "autotune", "bench", "fuse"} <= set(dir(tridist)))
loaded["SplitPoint.END"] = SplitPoint.END.name
print(json.dumps(loaded))
"""


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict:
    run = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(STEPS), json.dumps(HEAVY)],
                         cwd=tmp_path_factory.mktemp("imports"), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.mark.parametrize("step", list(NOT_PULLED))
def test_import_stays_light(loaded, step):
    pulled = NOT_PULLED[step] & set(loaded[step])
    first = {name: next(s for s in STEPS if name in loaded[s]) for name in pulled}
    assert not pulled, f"after {STEPS[step]!r}: {sorted(pulled)} loaded (each first loaded by the step {first})"


def test_top_level_reexports_and_pipelining_loads_when_used(loaded):
    assert loaded["reexports"] is True
    assert loaded["SplitPoint.END"] == "END" and "torch.distributed.pipelining" in loaded["distcore.SplitPoint"]
