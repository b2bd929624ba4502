"""Checks on several processes (harness.py). A process torchrun started (TORCHELASTIC_RUN_ID set: a worker, never
pytest) imports torch and transformers after this package with the garbage collector paused (~16% of an
import's CPU time); harness.run_checks collects once, freezes what the imports left and turns it back on. The
forked worlds' parent (forked_launch.py) pauses it itself; its workers inherit the frozen imports."""

import gc
import os

if "TORCHELASTIC_RUN_ID" in os.environ:
    gc.disable()
