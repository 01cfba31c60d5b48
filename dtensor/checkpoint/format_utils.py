"""Convert between this library's checkpoints and single ``torch.save`` files (PyTorch's
``torch.distributed.checkpoint.format_utils`` names).

* :func:`dcp_to_torch_save` assembles every tensor whole (each chunk's CRC-32 checked) and
  writes one ``torch.save`` file: ``{flattened key: tensor or value}``. The keys are the
  checkpoint's dotted keys (``model.w``): metadata.json records keys, not the nesting of
  the dicts they came from, so PyTorch's nested layout is not rebuilt.
* :func:`torch_save_to_dcp` reads a ``torch.save`` file of a state dict - without
  unpickling it: ``_torch_file`` decodes only tensors, dicts, lists, tuples and plain
  values and refuses any other object by name - and saves it as a checkpoint from this
  process alone.

Both run in one process, with no process group.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from dtensor.checkpoint._flatten import decode_value
from dtensor.checkpoint._read import _kept_checkpoint, read_metadata
from dtensor.checkpoint._torch_file import read_torch_file
from dtensor.checkpoint.api import save
from dtensor.checkpoint.errors import CheckpointError
from dtensor.checkpoint.tools import Assembler

__all__ = ["dcp_to_torch_save", "torch_save_to_dcp"]


def dcp_to_torch_save(
    dcp_checkpoint_dir: str | os.PathLike, torch_save_path: str | os.PathLike
) -> None:
    """Write a checkpoint as one ``torch.save`` file of ``{dotted key: full tensor or value}``.

    The whole model is held in memory at once (as with PyTorch's). To stay near the largest
    tensor instead, use ``python -m dtensor.checkpoint consolidate`` (safetensors).

    Example::

        >>> from dtensor.checkpoint.format_utils import dcp_to_torch_save
        >>> dcp_to_torch_save("ckpt/step-100", "full.pt")
        >>> torch.load("full.pt", weights_only=True)["model.w"].shape
        torch.Size([5, 4])
    """
    directory = _kept_checkpoint(Path(dcp_checkpoint_dir))
    md = read_metadata(directory)
    assembler = Assembler(directory, md)
    state = {key: assembler.full(key) for key in sorted(md.tensors)}
    state.update({key: decode_value(value) for key, value in sorted(md.values.items())})
    torch.save(state, torch_save_path)


def torch_save_to_dcp(
    torch_save_path: str | os.PathLike, dcp_checkpoint_dir: str | os.PathLike
) -> None:
    """Save the state dict of a ``torch.save`` file as a checkpoint (this process alone).

    The file is decoded, not unpickled: tensors (and parameters), dicts, lists, tuples and
    plain values only; any other object in it is refused by name.

    Example::

        >>> from dtensor.checkpoint.format_utils import torch_save_to_dcp
        >>> torch.save({"model": model.state_dict()}, "full.pt")
        >>> torch_save_to_dcp("full.pt", "ckpt/converted")   # then load it into any layout
    """
    state = read_torch_file(torch_save_path)
    if not isinstance(state, Mapping):
        raise CheckpointError(
            f"{torch_save_path} holds a {type(state).__name__}, not a state dict; save a dict"
        )
    save(dict(state), checkpoint_id=dcp_checkpoint_dir, no_dist=True)
