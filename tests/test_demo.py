"""The README's main job (`tridist demo`) runs end to end: to_distributed picks a strategy for the
local devices (2 CPU processes here), trains, and its losses match one device (exit status 0)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_runs_and_matches_one_device():
    # The fused kernels' PyTorch path, as on a CPU machine: the Triton interpreter (which the test suite
    # turns on, and checks elsewhere) would make this model's steps minutes long.
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "tridist.bench.demo", "--nproc", "2"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "losses match one device" in result.stdout and "strategy on 2" in result.stdout, result.stdout[-3000:]
