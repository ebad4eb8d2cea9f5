"""One device's memory as a sizing decision needs it: what is still free to allocate, what
tensors hold now, and the peak they held since the last reset."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceMemory:
    free: int       # bytes a new allocation can still get: the driver's free memory plus what
                    # the caching allocator holds unused (it hands that out first)
    allocated: int  # bytes in live tensors now
    peak: int       # the most bytes in live tensors since the last reset


def device_memory(device: torch.device | str, reset_peak: bool = False) -> DeviceMemory:
    """The device's memory now (zeros off CUDA, where nothing is measured); `reset_peak`
    starts a new peak from what is allocated now, after reading this one."""
    device = torch.device(device)
    if device.type != "cuda":
        return DeviceMemory(0, 0, 0)
    driver_free, _ = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    unused = torch.cuda.memory_reserved(device) - allocated
    peak = torch.cuda.max_memory_allocated(device)
    if reset_peak:
        torch.cuda.reset_peak_memory_stats(device)
    return DeviceMemory(driver_free + unused, allocated, peak)
