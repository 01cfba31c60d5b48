"""Read the tensors and plain values of a ``torch.save`` file without unpickling it.

A ``torch.save`` file is a zip archive: ``<name>/data.pkl`` (a pickle program describing the
object) and ``<name>/data/<key>`` (each storage's raw bytes). Unpickling would run that
program with Python's object machinery; this reader never does (this package never
unpickles). It decodes the program's opcodes with :func:`pickletools.genops` (a tokenizer
that builds nothing) and evaluates only what a state dict needs: dicts (``OrderedDict``
included), lists, tuples, str, int, float, bool, None, and tensors rebuilt from their
storages (``torch._utils._rebuild_tensor_v2`` / ``_rebuild_parameter``). Any other global -
anything that would construct an arbitrary object - is refused by name. That is a stricter
rule than ``torch.load(weights_only=True)``, whose allow-list it is a subset of.
"""

from __future__ import annotations

import pickletools
import zipfile
from collections import OrderedDict
from pathlib import Path

import torch

from dtensor.checkpoint.errors import CheckpointError

_STORAGES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}  # fmt: skip
_MARK = object()


class _Global:
    """A global the program names: one of the allowed constructors."""

    def __init__(self, name: str) -> None:
        self.name = name


def read_torch_file(path: str | Path):
    """The object a ``torch.save`` file holds, if it is made of state-dict parts only.

    Example::

        >>> read_torch_file("full.pt")["model"]["w"].shape
        torch.Size([5, 4])
    """
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"{path} is not a torch.save zip archive (the legacy format before PyTorch 1.6 "
            "is not read); re-save it with a current torch.save"
        )
    with zipfile.ZipFile(path) as z:
        pkl = [n for n in z.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkl) != 1:
            raise CheckpointError(f"{path}: expected one <name>/data.pkl, found {pkl}")
        prefix = pkl[0][: -len("data.pkl")]
        if f"{prefix}byteorder" in z.namelist() and z.read(f"{prefix}byteorder") != b"little":
            raise CheckpointError(f"{path} was saved on a big-endian machine; not read here")
        return _Program(z, prefix, path).run(z.read(pkl[0]))


class _Program:
    def __init__(self, archive: zipfile.ZipFile, prefix: str, path: Path) -> None:
        self.archive, self.prefix, self.path = archive, prefix, path
        self.stack: list = []
        self.memo: dict = {}
        self.storages: dict[str, torch.Tensor] = {}

    def run(self, data: bytes):
        try:
            for op, arg, _ in pickletools.genops(data):
                if op.name == "STOP":
                    return self.stack.pop()
                step = _STEPS.get(op.name)
                if step is None:
                    raise CheckpointError(f"{self.path}: opcode {op.name} is not read here")
                step(self, arg)
        except CheckpointError:
            raise
        except (ValueError, IndexError, KeyError, TypeError) as e:
            raise CheckpointError(f"{self.path}: not a plain state dict ({e})") from None
        raise CheckpointError(f"{self.path}: the pickle program has no STOP")

    def marked(self) -> list:
        i = len(self.stack) - 1 - self.stack[::-1].index(_MARK)
        items = self.stack[i + 1 :]
        del self.stack[i:]
        return items

    def storage(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CheckpointError(f"{self.path}: unexpected persistent id {pid!r}")
        _, kind, key, _location, numel = pid
        dtype = _STORAGES.get(kind.name.rsplit(".", 1)[-1]) if isinstance(kind, _Global) else None
        if dtype is None or not isinstance(key, str):
            raise CheckpointError(f"{self.path}: unexpected storage {pid!r}")
        if key not in self.storages:
            raw = bytearray(self.archive.read(f"{self.prefix}data/{key}"))
            flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
            if flat.numel() != numel:
                raise CheckpointError(f"{self.path}: storage {key} holds {flat.numel()} of {numel}")
            self.storages[key] = flat
        return self.storages[key]

    def reduce(self, _arg) -> None:
        args = self.stack.pop()
        fn = self.stack.pop()
        name = fn.name if isinstance(fn, _Global) else repr(fn)
        if name == "collections.OrderedDict" and args == ():
            self.stack.append(OrderedDict())
        elif name == "torch._utils._rebuild_tensor_v2":
            storage, offset, size, stride = args[:4]
            t = storage.as_strided(tuple(size), tuple(stride), offset)
            self.stack.append(t.requires_grad_(bool(args[4])) if t.is_floating_point() else t)
        elif name == "torch._utils._rebuild_parameter":
            self.stack.append(args[0])
        else:
            raise CheckpointError(
                f"{self.path}: refusing to call {name}: only tensors, dicts, lists, tuples and "
                "plain values are read (nothing is unpickled)"
            )

    def global_(self, arg: str) -> None:
        module, name = arg.split(" ", 1)
        full = f"{module}.{name}"
        allowed = {"collections.OrderedDict", "torch._utils._rebuild_tensor_v2",
                   "torch._utils._rebuild_parameter"}  # fmt: skip
        if full not in allowed and not (module == "torch" and name in _STORAGES):
            raise CheckpointError(f"{self.path}: refusing the global {full} (nothing is unpickled)")
        self.stack.append(_Global(full))


def _build(p: _Program, _arg) -> None:
    """``state_dict()``'s OrderedDict carries its modules' versions as ``_metadata``; keep it."""
    state = p.stack.pop()
    target = p.stack[-1]
    if not (
        isinstance(target, OrderedDict) and isinstance(state, dict) and set(state) <= {"_metadata"}
    ):
        raise CheckpointError(f"{p.path}: refusing to set the state of a {type(target).__name__}")
    target._metadata = state.get("_metadata")


def _setitems(p: _Program, _arg) -> None:
    items = p.marked()
    p.stack[-1].update(zip(items[::2], items[1::2], strict=True))


def _setitem(p: _Program, _arg) -> None:
    value, key = p.stack.pop(), p.stack.pop()
    p.stack[-1][key] = value


def _push(value_of):
    return lambda p, arg: p.stack.append(value_of(arg))


def _tuple(n: int):
    def step(p: _Program, _arg) -> None:
        items = p.stack[len(p.stack) - n :] if n else []
        del p.stack[len(p.stack) - n :]
        p.stack.append(tuple(items))

    return step


def _put(p: _Program, arg) -> None:
    p.memo[arg if arg is not None else len(p.memo)] = p.stack[-1]


_STEPS = {
    "PROTO": lambda p, a: None, "FRAME": lambda p, a: None,
    "EMPTY_DICT": _push(lambda a: {}), "EMPTY_LIST": _push(lambda a: []),
    "EMPTY_TUPLE": _push(lambda a: ()), "MARK": _push(lambda a: _MARK),
    "NONE": _push(lambda a: None), "NEWTRUE": _push(lambda a: True),
    "NEWFALSE": _push(lambda a: False),
    **{op: _push(lambda a: a) for op in ("BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT",
                                         "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8")},
    "TUPLE": lambda p, a: p.stack.append(tuple(p.marked())),
    "TUPLE1": _tuple(1), "TUPLE2": _tuple(2), "TUPLE3": _tuple(3),
    "BINPUT": _put, "LONG_BINPUT": _put, "MEMOIZE": lambda p, a: _put(p, None),
    "BINGET": lambda p, a: p.stack.append(p.memo[a]),
    "LONG_BINGET": lambda p, a: p.stack.append(p.memo[a]),
    "APPEND": lambda p, a: p.stack[-2].append(p.stack.pop()),
    "APPENDS": lambda p, a: (lambda items: p.stack[-1].extend(items))(p.marked()),
    "SETITEM": _setitem, "SETITEMS": _setitems, "BUILD": _build,
    "GLOBAL": _Program.global_, "REDUCE": _Program.reduce,
    "BINPERSID": lambda p, a: p.stack.append(p.storage(p.stack.pop())),
}  # fmt: skip
