"""The few collectives checkpointing needs: exchange small JSON documents, agree on errors.

Every exchange goes through ``all_gather`` of UTF-8 JSON bytes in a uint8 tensor, so nothing
is pickled (``all_gather_object`` would pickle). Without an initialized process group, the
"group" is this process alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.distributed as dist

from device_mesh import groups
from dtensor import debug
from dtensor.checkpoint.errors import CheckpointError


@dataclass(frozen=True)
class Group:
    """The ranks taking part, or just this process when ``pg`` is None.

    Example::

        >>> Group.of(None).size if not dist.is_initialized() else 1
        1
    """

    pg: object | None
    rank: int
    size: int

    @classmethod
    def of(cls, process_group=None) -> Group:
        if not (dist.is_available() and dist.is_initialized()):
            return cls(None, 0, 1)
        pg = process_group if process_group is not None else dist.group.WORLD
        return cls(pg, dist.get_rank(pg), dist.get_world_size(pg))

    def companion(self) -> Group:
        """A gloo group over the same ranks, for a background thread (created once per ranks).

        Only the ranks of this group take part in creating it. It lives in device_mesh's
        group cache, held weakly like every mesh group: ``destroy_process_group()`` frees it,
        and a re-initialized world gets a new one.
        """
        if self.pg is None:
            return self
        ranks = tuple(dist.get_process_group_ranks(self.pg))
        pg = groups.get_side_group(ranks, "gloo", purpose="checkpoint-background")
        return Group(pg, self.rank, self.size)

    def _device(self) -> torch.device:
        if dist.get_backend(self.pg) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_gather_json(self, obj) -> list:
        """Every rank's ``obj``, in rank order."""
        if self.pg is None:
            return [json.loads(json.dumps(obj))]
        data = json.dumps(obj, separators=(",", ":")).encode()
        device = self._device()
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        sizes = [torch.empty_like(size) for _ in range(self.size)]
        debug.note_collective("all_gather", self.pg, 8, mesh_dim="checkpoint")
        with debug.annotate_failures():
            dist.all_gather(sizes, size, group=self.pg)
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        mine = mine.to(device)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        debug.note_collective("all_gather", self.pg, longest, mesh_dim="checkpoint")
        with debug.annotate_failures():
            dist.all_gather(parts, mine, group=self.pg)
        return [
            json.loads(bytes(p[: int(s.item())].cpu().numpy()))
            for p, s in zip(parts, sizes, strict=True)
        ]

    def agree(self, problems: list[str], payload=None) -> list:
        """Share each rank's problems; raise the same :class:`CheckpointError` everywhere if any.

        Returns every rank's ``payload`` when no rank had a problem.
        """
        gathered = self.all_gather_json({"problems": problems, "payload": payload})
        by_message: dict[str, list[int]] = {}
        for rank, doc in enumerate(gathered):
            for p in doc["problems"]:
                by_message.setdefault(p, []).append(rank)
        if by_message:
            lines = [
                msg if self.size == 1 else f"{msg} [rank {_ranks(r)}]"
                for msg, r in by_message.items()
            ]
            raise CheckpointError("\n".join(lines))
        return [doc["payload"] for doc in gathered]


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
