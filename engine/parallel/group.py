"""The tensor-parallel process group: rendezvous, collectives, the step-plan channel.

Two groups over the same ranks, as vLLM keeps a device group and a CPU group:

* the *data* group (NCCL on CUDA, gloo on the CPU) carries
  the all-reduces, the logits gather and the hidden rows rank 0 broadcasts
  for logits. Its timeout (``--tp-timeout-s``) bounds every collective: a rank
  that stops answering mid-step turns into an error on the others, not a hang.
* the *control* group (always gloo) carries rank 0's pickled commands (step
  plans). A gloo timeout is each process's own: rank 0's sends are bounded by
  ``--tp-timeout-s`` like the data collectives, while a worker waits on it
  between steps for as long as the engine is idle (a long timeout); a dead
  engine is noticed by the worker's parent watch instead
  (engine/parallel/executor.py), and gloo fails a collective at once when a
  peer's connection closes.

torch.distributed keeps its process groups in module state of its own: one
tensor-parallel engine per process at a time (``init`` refuses a second).
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# How long a worker may wait for the engine's next command (an idle engine
# sends none); death on either side is detected by the process monitors.
_CONTROL_TIMEOUT = datetime.timedelta(days=7)
# How long the rendezvous waits for every rank to start (spawning a process and
# importing torch takes seconds on a loaded machine).
_STARTUP_TIMEOUT = datetime.timedelta(seconds=120)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the rendezvous (the TCP store on rank 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def backend_for(device: torch.device) -> str:
    """NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class TPGroup:
    """This process's rank in the tensor-parallel group and its collectives.

    Every rank must call the collectives in the same order (the model's forward
    does; rank 0's commands tell the workers what comes next)."""

    rank: int
    world_size: int
    device: torch.device
    data: Any  # dist.ProcessGroup (NCCL / gloo); Any: torch types groups loosely
    control: Any  # dist.ProcessGroup (gloo)
    startup: Any  # gloo, the rendezvous timeout: the hand-shake after loading

    @classmethod
    def init(
        cls, rank: int, world_size: int, port: int, device: torch.device, timeout_s: float
    ) -> TPGroup:
        """Join the group (blocks until every rank has joined, at most two minutes);
        ``timeout_s`` bounds every data collective afterwards."""
        if dist.is_initialized():
            raise RuntimeError(
                "a tensor-parallel engine already runs in this process (torch.distributed is "
                "initialized); close it first"
            )
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend_for(device),
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=_STARTUP_TIMEOUT,
        )
        bounded = datetime.timedelta(seconds=timeout_s)
        data = dist.new_group(backend=backend_for(device), timeout=bounded)
        control = dist.new_group(backend="gloo", timeout=bounded if rank == 0 else _CONTROL_TIMEOUT)
        # Ranks finish loading at different times: their first exchange waits longer.
        startup = dist.new_group(backend="gloo", timeout=_STARTUP_TIMEOUT)
        return cls(rank, world_size, device, data, control, startup)

    def all_reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.data)

    def broadcast(self, t: torch.Tensor) -> None:
        """Rank 0's ``t`` into every rank's ``t`` (same shape and dtype everywhere)."""
        dist.broadcast(t, src=0, group=self.data)

    def gather_columns(self, t: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's ``t`` ``[n, S]`` side by side, ``[n, world * S]``; others: None."""
        t = t.contiguous()
        if self.rank != 0:
            dist.gather(t, None, dst=0, group=self.data)
            return None
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.gather(t, parts, dst=0, group=self.data)
        return torch.cat(parts, dim=1)

    def send_command(self, command: object, startup: bool = False) -> None:
        """Rank 0: broadcast one pickled command on the control group (``startup``:
        the first one, on the start-up group, while the workers may still load)."""
        group = self.startup if startup else self.control
        dist.broadcast_object_list([command], src=0, group=group)

    def recv_command(self, startup: bool = False) -> object:
        """A worker: wait for rank 0's next command (``startup``: the first one)."""
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0, group=self.startup if startup else self.control)
        return box[0]

    def count_ready(self) -> int:
        """Every rank calls it once loaded: how many ranks are (start-up group)."""
        ready = torch.ones(1)
        dist.all_reduce(ready, group=self.startup)
        return int(ready.item())

    def close(self) -> None:
        """Leave the group (idempotent)."""
        if dist.is_initialized():
            dist.destroy_process_group()
