"""Device ordering: a WRITE of KV computed on a device is posted only once the device has computed it.

On a GPU the forward's kernels run asynchronously: when the engine hands the writer a layer (`save_kv_layer`) or
a chunk (`wait_for_save`), that layer's kernels may still be queued, and a WRITE posted then would copy KV not
computed yet. So the thread that runs the forward records a `KvReady` at that point (`Device.record`: on the
compute stream, without waiting) and hands it over with the part; the writer thread posts the part only once
`KvReady.done()` says the stream got there (it polls, as it polls its WRITEs), so the forward never blocks.

- `CpuDevice`: the forward is synchronous, so what it records is complete already (`COMPLETE`).
- `CudaDevice`: a `torch.cuda.Event` recorded on the current stream of the KV's device; done once `query()` is.

A `done()` that raises (a device error) fails the part's transfer with the error's text; so does one that is not
done within `WriterConfig.kv_ready_timeout_s`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from rendezvous.clients.nixl.regions import memory_kind_of
from rendezvous.protocol.enums import MemoryKind

if TYPE_CHECKING:
    import torch

__all__ = ["COMPLETE", "CpuDevice", "CudaDevice", "Device", "KvReady", "device_of"]


class KvReady(Protocol):
    """The point on a compute stream after which some KV is complete."""

    def done(self) -> bool:
        """Whether the stream got there (never blocks); raises on a device error."""
        ...


class Device(Protocol):
    """Where the forward computes KV: records `KvReady` points on its stream."""

    def record(self) -> KvReady:
        """A `KvReady` at this point of the calling thread's compute stream; does not wait."""
        ...


@dataclass(frozen=True, slots=True)
class _Complete:
    def done(self) -> bool:
        return True


COMPLETE: KvReady = _Complete()
"""What a synchronous device records: the KV is complete when the call returns."""


class CpuDevice:
    """The CPU: the forward is synchronous, so KV handed over is complete."""

    def record(self) -> KvReady:
        return COMPLETE


@dataclass(frozen=True, slots=True)
class _CudaReady:
    event: torch.cuda.Event

    def done(self) -> bool:
        return bool(self.event.query())  # type: ignore[no-untyped-call]


class CudaDevice:
    """A CUDA device: each `record` is a `torch.cuda.Event` on the current stream of `device`."""

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def record(self) -> KvReady:
        import torch

        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self._device))
        return _CudaReady(event)


def device_of(tensors: Sequence[torch.Tensor]) -> Device:
    """The device of KV `tensors` (all on one kind of device): `CudaDevice` for CUDA tensors, else `CpuDevice`."""
    if memory_kind_of(tensors) is MemoryKind.VRAM:
        return CudaDevice(tensors[0].device)
    return CpuDevice()
