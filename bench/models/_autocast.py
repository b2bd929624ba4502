"""A helper both reference models share."""

import contextlib

import torch


def autocast_disabled(device: torch.device):
    """Context forcing fp32 math under an active autocast; a no-op otherwise (also on meta/fake devices,
    where ``torch.autocast`` itself would raise)."""
    try:
        active = torch.is_autocast_enabled(device.type)
    except RuntimeError:  # device type without autocast support, e.g. "meta"
        active = False
    return torch.autocast(device_type=device.type, enabled=False) if active else contextlib.nullcontext()
