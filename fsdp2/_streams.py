"""Where a group's collectives run on a GPU, and how the compute stream waits for them.

On CUDA, communication gets its own streams so it overlaps the compute stream:

- the *gather* stream copies this rank's shards into the all-gather input (from pinned host
  memory under CPU offload) and issues the all-gather;
- the *reduce* stream lays the unsharded gradients out rank-major and issues the reduction.

Both first wait for the compute stream, so an all-gather never reads a shard the optimizer
is still writing, and a reduction never reads a gradient backward is still producing. The
compute stream waits for a collective through its work object (``work.wait()`` on NCCL
makes the *current* stream wait; the host does not block), then copies the gathered
parameters out or installs the reduced gradient shards itself.

[Note: stream-safe frees] No ``record_stream``: a buffer allocated on a side stream and last
used on the compute stream is freed only after the compute stream has waited for the
collective, and every later allocation on that side stream happens after the side stream
has waited for the compute stream. So the caching allocator can never hand the memory to
new work while old work still reads it, and memory use is what the program order says.
The unsharded gradients read by the reduce stream are kept alive by the pending reduction
until the compute stream has waited for it, for the same reason.

On CPU (gloo) every context here is a no-op: collectives already run on gloo's threads.
"""

from __future__ import annotations

import contextlib

import torch


class CommStreams:
    """The side streams of one device (one set per training root, in its ``CommContext``).

    Example:
        >>> streams = CommStreams(torch.device("cpu"))
        >>> with streams.gather():   # on CPU: runs on the calling thread, as before
        ...     pass
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.enabled = device.type == "cuda"
        if self.enabled:
            self.gather_stream = torch.cuda.Stream(device=device)
            self.reduce_stream = torch.cuda.Stream(device=device)

    def gather(self, after=None):
        """Context for an all-gather's copy-in and issue (the gather stream on CUDA).

        The gather stream first waits for the compute stream, or only for ``after`` (an
        event the user recorded after the optimizer step, ``set_post_optim_event``).
        """
        if not self.enabled:
            return contextlib.nullcontext()
        return self._on(self.gather_stream, after)

    def reduce(self):
        """Context for a reduction's copy-in and issue (the reduce stream on CUDA)."""
        return self._on(self.reduce_stream) if self.enabled else contextlib.nullcontext()

    @contextlib.contextmanager
    def _on(self, stream, after=None):
        if after is not None:
            stream.wait_event(after)
        else:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield

    def synchronize_compute(self) -> None:
        """Block the host until the compute stream has finished (CPU offload: before the
        host reads gradients copied from the device, or the optimizer writes parameters a
        copy-in may still read). No-op on CPU."""
        if self.enabled:
            torch.cuda.current_stream(self.device).synchronize()
