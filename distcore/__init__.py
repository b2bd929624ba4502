"""Paddle-style auto-parallel API on torch.distributed (not yet built)."""
