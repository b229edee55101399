"""Moving the synced parameters between the accelerator and the host through a small pinned
buffer, in chunks, two at a time.

Each outer round reads every parameter into one flat fp32 CPU vector and writes the result
back. A plain ``tensor.to("cpu")`` copies through pageable memory: on the H200 that
gpu-check ran on, about 1 GB/s, seconds per round for a model of a billion parameters. Pinning
the whole vector would lock a full fp32 copy of the model in host memory per rank; this keeps
two chunks pinned instead (``CHUNK`` floats each), so that the copy of one chunk across the
bus overlaps the copy of the other into (or out of) ordinary memory.

Tensors on the CPU take the direct path; so does everything when CUDA is not in use.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

CHUNK = 1 << 22  # floats per pinned buffer (16 MiB); two are kept


class HostStage:
    """Two pinned chunk buffers, made on first use on an accelerator and kept."""

    def __init__(self, chunk: int = CHUNK) -> None:
        self.chunk = chunk
        self._buffers: list[torch.Tensor] = []

    def _buffer(self, i: int) -> torch.Tensor:
        if not self._buffers:
            self._buffers = [torch.empty(self.chunk, dtype=torch.float32, pin_memory=True)
                             for _ in range(2)]
        return self._buffers[i % 2]

    def gather(self, parts: Sequence[torch.Tensor], numel: int) -> torch.Tensor:
        """`parts` flattened, converted to fp32 and concatenated into a new CPU vector."""
        out = torch.empty(numel, dtype=torch.float32)
        pending: list[tuple[torch.cuda.Event, torch.Tensor, torch.Tensor]] = []
        offset = i = 0
        for part in parts:
            flat = part.detach().reshape(-1)
            if not flat.is_cuda:
                out.narrow(0, offset, flat.numel()).copy_(flat)
                offset += flat.numel()
                continue
            flat = flat.float()  # converted on the device (a no-op for fp32)
            for start in range(0, flat.numel(), self.chunk):
                piece = flat.narrow(0, start, min(self.chunk, flat.numel() - start))
                if len(pending) == 2:  # the buffer about to be reused: empty it first
                    _drain(pending.pop(0))
                buf = self._buffer(i).narrow(0, 0, piece.numel())
                with torch.cuda.device(flat.device):
                    buf.copy_(piece, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record()
                pending.append((event, buf, out.narrow(0, offset, piece.numel())))
                offset += piece.numel()
                i += 1
        for item in pending:
            _drain(item)
        if offset != numel:
            raise ValueError(f"the parts hold {offset} elements, not {numel}")
        return out

    def upload(self, value: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`value` (fp32, CPU) as a new tensor on `device`, the same shape; on a device other
        than CUDA, `value.to(device)` (`value` itself on the CPU)."""
        if device.type != "cuda":
            return value.to(device)
        flat = value.reshape(-1)
        out = torch.empty(flat.numel(), dtype=flat.dtype, device=device)
        events: list[torch.cuda.Event | None] = [None, None]
        for i, start in enumerate(range(0, flat.numel(), self.chunk)):
            n = min(self.chunk, flat.numel() - start)
            if events[i % 2] is not None:  # the copy out of this buffer has finished
                events[i % 2].synchronize()
            buf = self._buffer(i).narrow(0, 0, n)
            buf.copy_(flat.narrow(0, start, n))
            with torch.cuda.device(device):
                out.narrow(0, start, n).copy_(buf, non_blocking=True)
                events[i % 2] = torch.cuda.Event()
                events[i % 2].record()
        for event in events:  # the buffers are free again before they are next written
            if event is not None:
                event.synchronize()
        return out.view(value.shape)


def _drain(item: tuple[torch.cuda.Event, torch.Tensor, torch.Tensor]) -> None:
    event, buf, dst = item
    event.synchronize()
    dst.copy_(buf)
