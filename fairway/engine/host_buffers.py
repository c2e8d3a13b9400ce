"""Host staging for a step's inputs: reused buffers, pinned when the device is a GPU, so each
upload is one asynchronous copy that does not wait for the GPU to finish the step before.

A buffer is refilled at the next step: safe once the step's copies have run. A step that samples
ends by copying the sampled ids to the host, which waits for everything queued before it, the
uploads included; one that samples nothing (a prompt's chunk short of its end) calls settle().
"""

from __future__ import annotations

import torch


class HostBuffers:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._buffers: dict[str, torch.Tensor] = {}

    def stage(self, name: str, values, dtype: torch.dtype, pad_to: int = 0, pad: float = 0) -> torch.Tensor:
        """The host view [max(len(values), pad_to)] of buffer `name` holding values, then pad."""
        n = len(values)
        size = max(n, pad_to)
        buf = self._buffer(name, size, dtype)[:size]
        view = buf.numpy()
        view[:n] = values
        view[n:] = pad
        return buf

    def stage_rows(self, name: str, rows: list[list[int]], width: int, dtype: torch.dtype,
                   pad_rows: int = 0) -> torch.Tensor:
        """Rows of different lengths as a contiguous [max(len(rows), pad_rows), width] host view,
        each padded with 0 (block tables: what lies past a row's context is never read)."""
        size = max(len(rows), pad_rows)
        buf = self._buffer(name, size * width, dtype)[:size * width].view(size, width)
        view = buf.numpy()
        view[:] = 0
        for i, row in enumerate(rows):
            view[i, :len(row)] = row
        return buf

    def upload(self, host: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """host (a staged view) on the device: into out when given (a static buffer), else a new tensor."""
        if out is None:
            return host.to(self.device, non_blocking=self.pinned)
        out.copy_(host, non_blocking=self.pinned)
        return out

    def settle(self) -> None:
        """Wait for the uploads queued so far (the buffers may be refilled afterwards)."""
        if self.pinned:
            torch.cuda.current_stream(self.device).synchronize()

    def _buffer(self, name: str, size: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < size or buf.dtype != dtype:
            # Grow by doubling: a pinned allocation is slow, so it is made rarely.
            capacity = max(size, 2 * (buf.numel() if buf is not None else 0), 64)
            buf = torch.empty(capacity, dtype=dtype, pin_memory=self.pinned)
            self._buffers[name] = buf
        return buf


