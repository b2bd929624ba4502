"""One file per fused op: its Triton kernels, launchers, torch.library registration, functional and layers."""
