"""Cost model and Optuna search over training strategies; Triton config sweeps (not yet built)."""
