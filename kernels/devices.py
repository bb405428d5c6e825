"""What kvtune reads of a device, one reader per fact: its arch, its name (both as a
defaults file's provenance spells them), its SM count and its opt-in shared memory per block.

`device` is a torch.device, a string such as 'cuda:1', or a CUDA ordinal (int). Torch caches
the other properties per device.
"""
from __future__ import annotations

import platform

import torch


def _cuda_index(device: torch.device | str | int) -> int | None:
    """The CUDA ordinal of `device`, None for a device that is not a CUDA one."""
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def device_arch(device: torch.device | str | int) -> str:
    """`sm_XY` of a CUDA device, `cpu` otherwise (the spelling of `provenance.arch`)."""
    idx = _cuda_index(device)
    if idx is None:
        return "cpu"
    major, minor = torch.cuda.get_device_capability(idx)
    return f"sm_{major}{minor}"


def device_name(device: torch.device | str | int) -> str:
    """The device's name as `provenance.device_name` spells it (the tuner records this too)."""
    idx = _cuda_index(device)
    if idx is None:
        return f"cpu ({platform.processor() or platform.machine()})"
    return torch.cuda.get_device_name(idx)


_SM_COUNTS: dict[int, int] = {}


def device_sm_count(device: torch.device | str | int) -> int | None:
    """SMs of a CUDA device (None for any other device), read once per device: the planning
    path of every launch asks."""
    idx = _cuda_index(device)
    if idx is None:
        return None
    if idx not in _SM_COUNTS:
        _SM_COUNTS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNTS[idx]


def device_smem_per_block(device: torch.device | str | int) -> int | None:
    """Opt-in shared memory per block of a CUDA device in bytes (None for any other device)."""
    idx = _cuda_index(device)
    return None if idx is None else torch.cuda.get_device_properties(idx).shared_memory_per_block_optin
