"""Point-to-point messages of parameter-server training (training/param_server.py).

Servers and workers exchange host-memory tensors with tagged isend/irecv, and a server takes
the next push from whichever worker rank sent it (`recv_any`: gloo's receive from any
source). On gloo worlds the default group carries them; when the default group is NCCL
(workers on GPUs), a gloo group over the whole world does, so servers never need a GPU.
Ranks are global ranks throughout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class PSChannel:
    """The messages of one parameter-server run over the world (create it on every rank, in
    the same order as other groups: it may create a gloo group)."""

    def __init__(self) -> None:
        self.group = None if str(dist.get_backend()).lower() == "gloo" else dist.new_group(backend="gloo")

    def send_object(self, obj, dst: int) -> None:
        """Send a picklable object to rank `dst` (blocking)."""
        dist.send_object_list([obj], dst=dst, group=self.group)

    def recv_object(self, src: int):
        """Receive the object rank `src` sends with `send_object` (blocking)."""
        box = [None]
        dist.recv_object_list(box, src=src, group=self.group)
        return box[0]

    def recv_any(self, tensor: torch.Tensor, tag: int) -> int:
        """Receive `tensor` from any rank sending with `tag`; returns the sender's rank."""
        return dist.recv(tensor, src=None, tag=tag, group=self.group)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        dist.recv(tensor, src=src, tag=tag, group=self.group)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int):
        """Start sending `tensor` (keep it alive until the returned work's `wait()`)."""
        return dist.isend(tensor, dst=dst, tag=tag, group=self.group)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int):
        return dist.irecv(tensor, src=src, tag=tag, group=self.group)
