"""Parallel styles: how one module's parameters, inputs and outputs are laid out over the
tensor-parallel mesh dim.

A style does three things to the module it is applied to:

1. replaces each parameter by an ``nn.Parameter`` holding a DTensor (a tied parameter met
   again is reused, not split twice);
2. hooks its inputs: a plain tensor is taken as this rank's piece of ``input_layouts`` and
   redistributed to the layout the computation needs;
3. hooks its outputs: redistributed to ``output_layouts``, and handed on as a plain local
   tensor when ``use_local_output``.

``ColwiseParallel`` and ``RowwiseParallel`` also give a plain ``nn.Linear`` / ``nn.Embedding``
a forward on local tensors ([Note: local compute] in ``_compute.py``); ``SequenceParallel``
keeps the module's own forward, which then runs on DTensors through the op rules.

[Note: subclasses keep their forward] A subclass of ``nn.Linear`` / ``nn.Embedding`` that
defines its own ``forward`` (a LoRA adapter, a quantized or scaled linear) keeps it: the
local forward would compute only ``F.linear`` and silently drop the rest. Its parameters are
its weight and bias laid out as the style lays out a plain module's, every other parameter
and buffer (its own and its submodules') replicated, and its forward runs on DTensors
through the op rules, as PyTorch's styles run every module: same answer, more dispatches.
(PyTorch's column-parallel style shards every parameter of the module like the weight,
which fails for a 1-D one such as a gain, and cannot place a submodule's; a replica is
right whatever the forward does with it.) A subclass that keeps ``nn.Linear``'s forward
(torchtitan's config ``Linear``) computes exactly what the local forward computes and gets
it.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.distributed as dist
from torch import nn

from device_mesh.switches import env_switch
from dtensor import debug
from dtensor._api import distribute_tensor
from dtensor._collectives import _dim_label as mesh_dim_label
from dtensor.parallel import _compute
from dtensor.parallel._regather import SaveShards
from dtensor.placement import (
    Placement,
    Replicate,
    Shard,
    chunk_sizes,
    format_placements,
    from_torch_placement,
    is_shard_like,
    is_torch_placement,
)
from dtensor.tensor import DTensor, redistribute_dtensor


class ParallelizeCall:
    """What the styles of one ``parallelize_module`` call share.

    ``src_data_rank``: the rank whose values every parameter takes (scattered or broadcast
    from it), or None for each rank slicing its own values without communicating.
    ``done``: the id of every parameter already distributed, to its replacement, so a tied
    weight is distributed once and every module that holds it gets the same parameter.
    """

    def __init__(self, src_data_rank: int | None = 0) -> None:
        self.src_data_rank = src_data_rank
        self.done: dict[int, nn.Parameter] = {}


class ParallelStyle:
    """Base class of the styles ``parallelize_module`` applies.

    A subclass sets ``supported`` (module types; empty means any) and implements
    ``_apply(module, device_mesh)``, PyTorch's abstract method, so styles written for
    PyTorch (torchtitan's ``NoParallel``) work unchanged. The styles here take a third
    argument, ``call``, the ``ParallelizeCall`` in progress; ``parallelize_module`` passes it
    to an ``_apply`` that has a parameter of that name. A plan maps module paths to
    instances of its subclasses.

    Example:
        >>> plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel()}
        >>> all(isinstance(style, ParallelStyle) for style in plan.values())
        True
    """

    supported: tuple = ()
    #: The mesh rank whose values the others take, set by ``parallelize_module`` before it
    #: calls a PyTorch-style ``_apply`` (PyTorch's styles read ``self.src_data_rank``).
    src_data_rank: int | None = 0

    def _check(self, module: nn.Module, path: str) -> None:
        """Raise before anything changes if this style cannot apply to ``module``."""
        if self.supported and not isinstance(module, self.supported):
            names = " or ".join(t.__name__ for t in self.supported)
            raise TypeError(
                f"parallelize_module: {type(self).__name__} applies to {names}, but "
                f"{path or 'the module'!r} is a {type(module).__name__}. Apply it to the "
                "Linear/Embedding children instead, or use PrepareModuleInput/"
                "PrepareModuleOutput/SequenceParallel for this module."
            )

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        """Lay ``module`` out over ``device_mesh`` (in place); return it."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement _apply(self, module, device_mesh), as "
            "PyTorch's ParallelStyle subclasses do."
        )

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


# --------------------------------------------------------------------------- helpers
def _layout(p, name: str, style: str, default: Placement | None = None):
    if p is None:
        return default
    if isinstance(p, (tuple, list)) and len(p) == 1:
        p = p[0]
    p = from_torch_placement(p)  # PyTorch's pass isinstance(p, Placement) unconverted
    if not isinstance(p, Placement) or is_torch_placement(p):
        raise TypeError(
            f"{style}: {name} must be a placement such as Shard(1) or Replicate(), got {p!r} "
            f"({type(p).__module__}.{type(p).__qualname__})."
        )
    return p


def _distribute(
    module: nn.Module, name: str, mesh, placement: Placement, call: ParallelizeCall
) -> None:
    """Replace ``module.<name>`` by a DTensor parameter laid out as ``placement``."""
    param = module._parameters.get(name)  # an Embedding has no bias
    if param is None:
        return
    if id(param) in call.done:
        param = call.done[id(param)]
    if isinstance(param, DTensor):
        if param.placements != (placement,) or param.device_mesh != mesh:
            raise ValueError(
                f"parallelize_module: parameter {name!r} of {type(module).__name__} is tied to "
                f"one already laid out as {format_placements(param.placements)}, but this style "
                f"wants ({placement}). Give tied modules styles that shard the shared weight "
                "the same way (e.g. RowwiseParallel on the embedding, ColwiseParallel on the "
                "output projection: both Shard(0))."
            )
        module._parameters[name] = param
        return
    src = None if param.device.type == "meta" else call.src_data_rank
    dt = distribute_tensor(param.detach(), mesh, (placement,), src_data_rank=src)
    new = nn.Parameter(dt, requires_grad=param.requires_grad)
    if placement.is_replicate():
        _settle_before_forward(module, name)
    call.done[id(param)] = new
    module._parameters[name] = new


def _settle_grad(param) -> None:
    """A replicated parameter used on sequence shards (norm weights, a row-parallel bias
    before a sequence-sharded output) gets partial-sum gradients; sum them once here, so
    every ``.grad`` is laid out like its parameter and the optimizer and clipping reduce
    nothing (they would all-reduce it again at every op that reads it)."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = redistribute_dtensor(grad, param.placements)


def _settle_before_forward(module: nn.Module, name: str) -> None:
    """Give ``module.<name>`` the ``_settle_grad`` hook, checked again before every
    forward: ``to_empty()`` after building on the meta device (or a ``load_state_dict`` with
    ``assign=True``) puts new ``Parameter`` objects in place, without the old one's hooks."""
    names = module.__dict__.setdefault("_tp_settled_names", [])
    if not names:
        module.register_forward_pre_hook(_eager(_hook_replicated_params))
    if name not in names:
        names.append(name)


def _hook_replicated_params(module: nn.Module, args) -> None:
    for name in module._tp_settled_names:
        param = module._parameters.get(name)
        if param is not None and param.requires_grad and not getattr(param, "_tp_settles", False):
            param.register_post_accumulate_grad_hook(_eager(_settle_grad))
            param._tp_settles = True


def _as_input(
    x, mesh, layout, desired, saver: SaveShards | None = None, *, uneven=False, last=None
):
    """``x`` as a DTensor in ``desired`` (a plain tensor is this rank's piece of ``layout``,
    its global shape derived by ``_global_shape(x, mesh, layout, uneven, last)``).

    With a ``saver``, an input gathered from a shard is noted in it, so that the module's
    backward keeps the shard rather than the gathered tensor ([Note: regather in backward])."""
    if layout is None or not isinstance(x, torch.Tensor):
        return x
    if isinstance(x, DTensor):
        if x.device_mesh != mesh:
            raise ValueError(
                f"parallelize_module: an input DTensor lives on {x.device_mesh!r}, not on the "
                f"tensor-parallel mesh {mesh!r}."
            )
        dt = x
    else:
        shape = _global_shape(x, mesh, layout, uneven, last)
        dt = DTensor.from_local(x, mesh, (layout,), shape=shape)
    if desired is not None and dt.placements != (desired,):
        shard, before = dt._local(), dt.placements[0]
        dt = dt.redistribute(placements=(desired,))
        if saver is not None and before.is_shard() and desired.is_replicate():
            saver.add(dt._local(), shard, mesh, before, dt.shape)
    return dt


def _global_shape(x: torch.Tensor, mesh, layout, uneven: bool, last: int | None) -> torch.Size:
    """The global shape of the tensor whose ``layout`` piece ``x`` is on this rank.

    [Note: global sizes of plain inputs] A plain tensor carries no global shape, and asking
    the other ranks costs a collective and, on CUDA, a host sync on every forward. So:

    * sharded on the last dim, with ``last`` given (a row-parallel Linear's ``in_features``):
      that size, exact even for an uneven split;
    * otherwise, by default, the shards are taken as even: global = local x mesh size, as
      PyTorch's styles and ``DTensor.from_local`` take them. Nothing is communicated;
    * with ``uneven`` (the style's ``uneven_shards=True``), the ranks' sizes along the dim
      are exchanged: one all-gather of one number per rank and a host sync per call, for
      inputs whose length need not divide by the mesh size (a sequence of any length
      under sequence parallelism). They must be ``torch.chunk``'s pieces.

    Taking uneven shards as even gives the ranks different global shapes: on gloo the next
    collective aborts a rank's process (gloo's size check, which Python cannot catch) while
    another may return a wrong shape, as with PyTorch's styles: that is what
    ``uneven_shards`` is for. To find the
    input, run with ``DTENSOR_CHECK_SHARDS=1``: every plain shard input then exchanges its
    sizes, and one taken as even that is not raises, naming the fix, on every rank.
    """
    if not is_shard_like(layout) or mesh.size() == 1:
        return x.shape
    dim = layout.dim % x.ndim
    shape = list(x.shape)
    if last is not None and dim == x.ndim - 1:
        shape[dim] = last
    elif uneven or env_switch("DTENSOR_CHECK_SHARDS"):
        shape[dim] = _exchanged_size(x, dim, mesh, even=not uneven)
    else:
        shape[dim] = x.shape[dim] * mesh.size()
    return torch.Size(shape)


def _exchanged_size(x: torch.Tensor, dim: int, mesh, even: bool) -> int:
    """The sum over the ranks of ``x.shape[dim]``, checked to be ``torch.chunk``'s pieces
    (with ``even``, equal ones: the check of ``DTENSOR_CHECK_SHARDS=1``)."""
    mine = torch.tensor([x.shape[dim]], dtype=torch.int64, device=x.device)
    sizes = [torch.empty_like(mine) for _ in range(mesh.size())]
    group = mesh.get_group()
    debug.record(
        "all_gather", mesh_dim_label(mesh, 0), mesh.size(), mine.element_size(), group=group
    )
    with debug.annotate_failures():
        dist.all_gather(sizes, mine, group=group)
    sizes = torch.cat(sizes).tolist()  # one read on the host
    total = sum(sizes)
    if even and len(set(sizes)) != 1:
        raise ValueError(
            f"parallelize_module: the ranks hold {sizes} entries of dim {dim} of a plain input "
            f"taken as even Shard({dim}) pieces. Pass uneven_shards=True to the style that "
            f"receives it (its sizes are then exchanged on every call), make the length "
            f"divisible by {mesh.size()}, or pass a DTensor."
        )
    if sizes != chunk_sizes(total, mesh.size()):
        raise ValueError(
            f"parallelize_module: the ranks hold {sizes} entries of dim {dim} of an input "
            f"taken as Shard({dim}); they must be the torch.chunk pieces of {total} "
            f"({chunk_sizes(total, mesh.size())}). Shard the input with torch.chunk, or pass "
            "a DTensor."
        )
    return total


def _as_output(y, mesh, layout, desired, use_local: bool, uneven: bool = False):
    if not isinstance(y, torch.Tensor):
        return y
    if not isinstance(y, DTensor):
        if layout is None:
            return y
        shape = _global_shape(y, mesh, layout, uneven, None)
        y = DTensor.from_local(y, mesh, (layout,), shape=shape)
    if desired is not None and y.placements != (desired,):
        y = y.redistribute(placements=(desired,))
    return y.to_local() if use_local else y


def _eager(fn):
    """``fn`` run eagerly even inside a ``torch.compile``d region: the styles' hooks and local
    forwards build DTensors around local tensors and run collectives, which dynamo cannot trace
    for this DTensor; the code between planned modules is compiled (see docs/compile.md)."""
    return torch.compiler.disable(fn)


def _hook_inputs(module: nn.Module, prepare, regather: bool) -> None:
    """Register ``prepare(args, kwargs, saver) -> (args, kwargs)`` as ``module``'s input
    hook. With ``regather``, tensors that the forward saves from inputs ``prepare`` gathered
    are kept as their shards until the forward returns ([Note: regather in backward])."""
    active: list[SaveShards | None] = []

    def before(_, args, kwargs):
        active.append(None)  # popped by ``after`` even if ``prepare`` raises
        saver = SaveShards() if regather and torch.is_grad_enabled() else None
        args, kwargs = prepare(args, kwargs, saver)
        if saver:
            active[-1] = saver.__enter__()
        return args, kwargs

    def after(*_):
        if active:
            saver = active.pop()
            if saver is not None:
                saver.__exit__(None, None, None)

    module.register_forward_pre_hook(_eager(before), with_kwargs=True)
    module.register_forward_hook(_eager(after), always_call=True)


def _set_forward(module: nn.Module, fn) -> None:
    """Give ``module`` a forward on local tensors (an instance attribute: hooks still run)."""
    module.forward = types.MethodType(_eager(fn), module)


def _computes_as(module: nn.Module, base: type) -> bool:
    """Whether ``module``'s forward is ``base``'s own (``nn.Linear`` / ``nn.Embedding``),
    so the local forward computes the same ([Note: subclasses keep their forward])."""
    return "forward" not in module.__dict__ and type(module).forward is base.forward


def _distribute_subclass(module, mesh, call, weight: Placement, bias: Placement) -> None:
    """Lay out a subclass that keeps its forward: ``weight`` and ``bias`` as given, every
    other parameter and buffer of it and its submodules replicated (its forward then sees
    DTensors only; [Note: subclasses keep their forward])."""
    own = {"weight": weight, "bias": bias}
    for sub in module.modules():
        for name in list(sub._parameters):
            placement = own.get(name, Replicate()) if sub is module else Replicate()
            _distribute(sub, name, mesh, placement, call)
        for name, buf in list(sub._buffers.items()):
            if buf is not None and not isinstance(buf, DTensor):
                src = None if buf.device.type == "meta" else call.src_data_rank
                sub._buffers[name] = distribute_tensor(buf, mesh, (Replicate(),), src_data_rank=src)


# --------------------------------------------------------------------------- Linear / Embedding
class ColwiseParallel(ParallelStyle):
    """Shard a ``Linear``'s output features (weight and bias ``Shard(0)``) or an ``Embedding``'s
    embedding dim (weight ``Shard(1)``) over the mesh.

    The input is gathered to ``Replicate`` (from ``input_layouts``, default ``Replicate()``);
    the output is the feature-sharded result, ``Shard(-1)``, redistributed to
    ``output_layouts`` and handed on as a local tensor when ``use_local_output``. An input
    gathered from a shard is saved for backward as the shard and gathered again there;
    ``regather_in_backward=False`` keeps the gathered tensor instead, as PyTorch's style does
    ([Note: regather in backward]). A Linear's input sharded on its last dim takes its
    global size from ``in_features``; one sharded on another dim is taken as even pieces,
    as in PyTorch, unless ``uneven_shards=True``: then it may be any ``torch.chunk`` piece and
    the ranks' sizes are exchanged on every call (a small all-gather and a host sync;
    [Note: global sizes of plain inputs]).

    Example:
        >>> parallelize_module(mlp, mesh["tp"], {"fc": ColwiseParallel(),
        ...                                      "out": RowwiseParallel()})
    """

    supported = (nn.Linear, nn.Embedding)

    def __init__(
        self,
        *,
        input_layouts=None,
        output_layouts=None,
        use_local_output=True,
        regather_in_backward: bool = True,
        uneven_shards: bool = False,
    ):
        self.input_layouts = _layout(input_layouts, "input_layouts", "ColwiseParallel", Replicate())
        self.output_layouts = _layout(
            output_layouts, "output_layouts", "ColwiseParallel", Shard(-1)
        )
        self.use_local_output = use_local_output
        self.regather_in_backward = regather_in_backward
        self.uneven_shards = uneven_shards

    def _check(self, module, path):
        super()._check(module, path)
        if isinstance(module, nn.Embedding) and module.max_norm is not None:
            raise NotImplementedError(
                f"parallelize_module: ColwiseParallel on {path!r}: Embedding(max_norm=...) "
                "needs the norm of whole rows, which are split; drop max_norm or use "
                "RowwiseParallel."
            )

    def _apply(self, module, mesh, call):
        base = nn.Linear if isinstance(module, nn.Linear) else nn.Embedding
        shard = Shard(0) if base is nn.Linear else Shard(1)
        if not _computes_as(module, base):  # [Note: subclasses keep their forward]
            _distribute_subclass(module, mesh, call, shard, shard)
        elif base is nn.Linear:
            _distribute(module, "weight", mesh, shard, call)
            _distribute(module, "bias", mesh, shard, call)
            _set_forward(module, _compute.colwise_linear)
        else:
            _distribute(module, "weight", mesh, shard, call)
            _set_forward(module, _compute.colwise_embedding)
        layout, uneven = self.input_layouts, self.uneven_shards
        last = module.in_features if base is nn.Linear else None

        def prepare(args, kwargs, saver):
            x = _as_input(args[0], mesh, layout, Replicate(), saver, uneven=uneven, last=last)
            return (x, *args[1:]), kwargs

        _hook_inputs(module, prepare, self.regather_in_backward)
        out, local = self.output_layouts, self.use_local_output
        module.register_forward_hook(_eager(lambda _, __, y: _as_output(y, mesh, None, out, local)))


class RowwiseParallel(ParallelStyle):
    """Shard a ``Linear``'s input features (weight ``Shard(1)``, bias replicated) or an
    ``Embedding``'s rows (the vocabulary, weight ``Shard(0)``) over the mesh.

    The input arrives as ``input_layouts`` (default ``Shard(-1)`` for a Linear - the output
    of a ``ColwiseParallel`` one - and ``Replicate()`` for an Embedding); the partial results
    are summed into ``output_layouts`` (default ``Replicate()``: an all-reduce; ``Shard(1)``:
    a reduce-scatter over the sequence). A Linear's input sharded on its last dim takes its
    global size from ``in_features``; one sharded on another dim is taken as even pieces,
    as in PyTorch, unless ``uneven_shards=True``: then it may be any ``torch.chunk`` piece and
    the ranks' sizes are exchanged on every call (a small all-gather and a host sync;
    [Note: global sizes of plain inputs]).

    Example:
        >>> RowwiseParallel(output_layouts=Shard(1))   # sequence-parallel block output
    """

    supported = (nn.Linear, nn.Embedding)

    def __init__(
        self,
        *,
        input_layouts=None,
        output_layouts=None,
        use_local_output=True,
        uneven_shards: bool = False,
    ):
        self.input_layouts = _layout(input_layouts, "input_layouts", "RowwiseParallel")
        self.output_layouts = _layout(
            output_layouts, "output_layouts", "RowwiseParallel", Replicate()
        )
        self.use_local_output = use_local_output
        self.uneven_shards = uneven_shards

    def _check(self, module, path):
        super()._check(module, path)
        if isinstance(module, nn.Embedding) and (
            module.padding_idx is not None or module.max_norm is not None or module.sparse
        ):
            raise NotImplementedError(
                f"parallelize_module: RowwiseParallel on {path!r}: an Embedding with "
                "padding_idx, max_norm or sparse=True is not supported with its rows split; "
                "use ColwiseParallel for it."
            )

    def _apply(self, module, mesh, call):
        out, local = self.output_layouts, self.use_local_output
        if isinstance(module, nn.Linear):
            base, weight, fn = nn.Linear, Shard(1), _compute.rowwise_linear
            layout = desired = Shard(-1)
        else:
            base, weight, fn = nn.Embedding, Shard(0), _compute.rowwise_embedding
            layout = desired = Replicate()
        layout = self.input_layouts or layout
        uneven = self.uneven_shards
        last = module.in_features if base is nn.Linear else None
        if _computes_as(module, base):
            _distribute(module, "weight", mesh, weight, call)
            _distribute(module, "bias", mesh, Replicate(), call)
            module.forward = _eager(functools.partial(fn, module, output_layout=out))
            reduce_to = None  # the local forward returns the output laid out already
        else:  # [Note: subclasses keep their forward]: partial sums out of the op rules
            _distribute_subclass(module, mesh, call, weight, Replicate())
            reduce_to = out
        module.register_forward_pre_hook(
            _eager(
                lambda _, args: (
                    _as_input(args[0], mesh, layout, desired, uneven=uneven, last=last),
                    *args[1:],
                )
            )
        )
        module.register_forward_hook(
            _eager(lambda _, __, y: _as_output(y, mesh, None, reduce_to, local))
        )


# --------------------------------------------------------------------------- sequence parallel
class SequenceParallel(ParallelStyle):
    """Run a module (a norm, dropout) on activations sharded along ``sequence_dim``.

    Its parameters are replicated over the mesh; its input is taken as this rank's slice of
    the sequence (``Shard(sequence_dim)``), and its forward runs on DTensors through the op
    rules, so the parameters' gradients come out as partial sums that are reduced for them.
    The output stays a DTensor unless ``use_local_output``.

    A plain input is taken as an even piece of the sequence (global length = local length x
    mesh size), as in PyTorch; with ``uneven_shards=True`` it may be any ``torch.chunk``
    piece (a sequence whose length does not divide by the mesh size), and the ranks' lengths
    are exchanged on every call: a small all-gather and a host sync ([Note: global sizes of
    plain inputs]).

    Example:
        >>> parallelize_module(block, mesh["tp"], {"ln1": SequenceParallel()})
        >>> SequenceParallel(uneven_shards=True)   # sequences of any length
    """

    def __init__(
        self,
        *,
        sequence_dim: int = 1,
        use_local_output: bool = False,
        uneven_shards: bool = False,
    ):
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output
        self.uneven_shards = uneven_shards

    def _apply(self, module, mesh, call):
        for sub in module.modules():
            for name in list(sub._parameters):
                _distribute(sub, name, mesh, Replicate(), call)
        seq, uneven = Shard(self.sequence_dim), self.uneven_shards
        module.register_forward_pre_hook(
            _eager(lambda _, args: (_as_input(args[0], mesh, seq, seq, uneven=uneven), *args[1:]))
        )
        local = self.use_local_output
        module.register_forward_hook(
            _eager(lambda _, __, y: _as_output(y, mesh, None, None, local))
        )


# --------------------------------------------------------------------------- layouts only
def _layouts(value, name: str, style: str) -> tuple | None:
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return tuple(_layout(p, name, style) for p in value)
    return (_layout(value, name, style),)


class PrepareModuleInput(ParallelStyle):
    """Redistribute a module's positional inputs from ``input_layouts`` to
    ``desired_input_layouts`` (one entry per input; ``None`` leaves that input alone).

    Inputs gathered from a shard (``Shard(1) -> Replicate()`` before the column-parallel
    linears of a sequence-parallel block) are saved for backward as their shards and gathered
    again there, once per backward pass; ``regather_in_backward=False`` keeps the gathered
    tensors instead, as PyTorch's style does ([Note: regather in backward]).
    ``uneven_shards``: a plain input taken as a ``Shard`` may be any ``torch.chunk`` piece
    (a sequence whose length does not divide by the mesh size); its ranks' sizes are then
    exchanged on every call (a small all-gather and a host sync). By default shards are
    taken as even, as in PyTorch ([Note: global sizes of plain inputs]).

    Example:
        >>> PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    """

    def __init__(
        self,
        *,
        input_layouts=None,
        desired_input_layouts=None,
        input_kwarg_layouts=None,
        desired_input_kwarg_layouts=None,
        use_local_output: bool = False,
        regather_in_backward: bool = True,
        uneven_shards: bool = False,
    ):
        style = "PrepareModuleInput"
        self.input_layouts = _layouts(input_layouts, "input_layouts", style)
        self.desired_input_layouts = _layouts(desired_input_layouts, "desired_input_layouts", style)
        self.input_kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_input_kwarg_layouts = dict(desired_input_kwarg_layouts or {})
        self.use_local_output = use_local_output
        self.regather_in_backward = regather_in_backward
        self.uneven_shards = uneven_shards
        if (self.input_layouts is None) != (self.desired_input_layouts is None) or (
            self.input_layouts is not None
            and len(self.input_layouts) != len(self.desired_input_layouts)
        ):
            raise ValueError(
                f"{style}: input_layouts {self.input_layouts} and desired_input_layouts "
                f"{self.desired_input_layouts} must have one entry each per input."
            )
        if set(self.input_kwarg_layouts) != set(self.desired_input_kwarg_layouts):
            raise ValueError(
                f"{style}: input_kwarg_layouts and desired_input_kwarg_layouts must name the "
                f"same keyword arguments, got {sorted(self.input_kwarg_layouts)} and "
                f"{sorted(self.desired_input_kwarg_layouts)}."
            )

    def _convert(self, x, mesh, layout, desired, saver):
        if layout is None or not isinstance(x, torch.Tensor):
            return x
        dt = _as_input(x, mesh, layout, desired, saver, uneven=self.uneven_shards)
        return dt.to_local() if self.use_local_output else dt

    def _apply(self, module, mesh, call):
        def prepare(args, kwargs, saver):
            args = list(args)
            if self.input_layouts is not None:
                if len(args) < len(self.input_layouts):
                    raise ValueError(
                        f"PrepareModuleInput on {type(module).__name__}: expected at least "
                        f"{len(self.input_layouts)} positional inputs, got {len(args)}."
                    )
                for i, (lay, want) in enumerate(
                    zip(self.input_layouts, self.desired_input_layouts, strict=True)
                ):
                    args[i] = self._convert(args[i], mesh, lay, want, saver)
            for key, lay in self.input_kwarg_layouts.items():
                if key in kwargs:
                    want = _layout(self.desired_input_kwarg_layouts[key], key, "PrepareModuleInput")
                    lay = _layout(lay, key, "")
                    kwargs[key] = self._convert(kwargs[key], mesh, lay, want, saver)
            return tuple(args), kwargs

        _hook_inputs(module, prepare, self.regather_in_backward)


class PrepareModuleOutput(ParallelStyle):
    """Redistribute a module's outputs from ``output_layouts`` to ``desired_output_layouts``.

    ``uneven_shards``: a plain output taken as a ``Shard`` may be any ``torch.chunk`` piece;
    its ranks' sizes are then exchanged on every call (by default shards are taken as even,
    [Note: global sizes of plain inputs]).

    Example:
        >>> PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),))
    """

    def __init__(
        self,
        *,
        output_layouts,
        desired_output_layouts,
        use_local_output: bool = True,
        uneven_shards: bool = False,
    ):
        style = "PrepareModuleOutput"
        self.output_layouts = _layouts(output_layouts, "output_layouts", style)
        self.desired_output_layouts = _layouts(
            desired_output_layouts, "desired_output_layouts", style
        )
        self.use_local_output = use_local_output
        self.uneven_shards = uneven_shards
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise ValueError(
                f"{style}: output_layouts and desired_output_layouts must have one entry each "
                f"per output, got {len(self.output_layouts)} and "
                f"{len(self.desired_output_layouts)}."
            )

    def _apply(self, module, mesh, call):
        def hook(_, __, out):
            single = not isinstance(out, (tuple, list))
            outs = (out,) if single else tuple(out)
            if len(outs) != len(self.output_layouts):
                raise ValueError(
                    f"PrepareModuleOutput on {type(module).__name__}: the module returned "
                    f"{len(outs)} outputs but output_layouts has {len(self.output_layouts)}."
                )
            new = tuple(
                _as_output(y, mesh, lay, want, self.use_local_output, self.uneven_shards)
                for y, lay, want in zip(outs, self.output_layouts, self.desired_output_layouts)
            )
            return new[0] if single else type(out)(new)

        module.register_forward_hook(_eager(hook))


class PrepareModuleInputOutput(ParallelStyle):
    """``PrepareModuleInput`` and ``PrepareModuleOutput`` on one module, with PyTorch's
    arguments: the inputs' layouts (``use_local_input``: hand the module local tensors) and
    the outputs' (``use_local_output``, default True: return local tensors).

    Example:
        >>> PrepareModuleInputOutput(
        ...     input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),),
        ...     output_layouts=Replicate(), desired_output_layouts=Shard(0))
    """

    def __init__(
        self,
        *,
        input_layouts=None,
        desired_input_layouts=None,
        input_kwarg_layouts=None,
        desired_input_kwarg_layouts=None,
        use_local_input: bool = False,
        output_layouts,
        desired_output_layouts,
        use_local_output: bool = True,
    ):
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts,
            desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input,
        )
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts,
            desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output,
        )

    def _check(self, module, path):
        self.prepare_module_input._check(module, path)
        self.prepare_module_output._check(module, path)

    def _apply(self, module, mesh, call=None):
        self.prepare_module_input._apply(module, mesh, call)
        self.prepare_module_output._apply(module, mesh, call)
        return module
