"""Capture: an ``nn.Module`` (+ loss function) becomes one flat torch.fx GraphModule of ATen ops.

``torch.export`` (non-strict) is the default tracer; ``symbolic_trace`` is offered on request and
its result is normalised through ``torch.export`` so every later pass sees the same ATen IR.
Parameters stay ``get_attr`` nodes named by their module path, and every call node keeps the
``nn_module_stack`` torch records, so module paths remain readable after capture.
"""
from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import sysconfig
import traceback
from collections.abc import Mapping
from contextlib import contextmanager

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module

from autopar.errors import CaptureError
from autopar.ir.captured_graph import NUM_ITEMS, CapturedGraph, ItemCount
from autopar.passes.frontend.devices import retarget_devices
from autopar.passes.frontend.dynamic_capture import export_dynamic_shapes, export_ranges, read_dynamic_dims
from autopar.passes.frontend.item_count import LABELS, item_count_spec
from autopar.passes.frontend.shape_prop import to_fake

__all__ = ["capture", "caches_off", "model_loss", "CAPTURE_MODES"]

log = logging.getLogger(__name__)

CAPTURE_MODES = ("export", "symbolic_trace")


def _call(model: nn.Module, inputs, keywords: tuple[str, ...] | None):
    return model(**dict(zip(keywords, inputs))) if keywords else model(*inputs)


def model_loss(output):
    """The loss a model computed itself: ``output.loss`` (HF ``ModelOutput``), ``output["loss"]`` or ``output[0]``."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)) and output:
        loss = output[0]
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise CaptureError(f"the model returned no scalar loss ({type(output).__name__}) for a batch with labels",
                           where="the model's output (training on its own loss: no loss_fn, a `labels` input)",
                           fix="make the model return its loss for `labels` (output.loss), or pass loss_fn= and "
                               "example_target=")
    return loss


class _WithLoss(nn.Module):
    """forward(*inputs, target) -> loss_fn(model(*inputs), target): the training graph's root."""

    def __init__(self, model: nn.Module, loss_fn, keywords=None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.keywords = keywords

    def forward(self, *args):
        *inputs, target = args
        return self.loss_fn(_call(self.model, inputs, self.keywords), target)


class _ModelLoss(nn.Module):
    """forward(*inputs) -> model(**inputs).loss: training on the loss the model computes from ``labels``.

    ``reweight``: the model takes ``num_items_in_batch`` but its loss ignores it (a mean over the
    call's own label tokens, T5's and BART's): the loss is turned into the form the count expects,
    ``mean · n / count`` with ``n`` the call's counted label tokens, so the microbatches and dp
    replicas of a step weigh each token as one device does (0 for a call without label tokens).
    """

    def __init__(self, model: nn.Module, keywords, reweight: ItemCount | None = None):
        super().__init__()
        self.model = model
        self.keywords = keywords
        self.reweight = reweight

    def forward(self, *args):
        loss = model_loss(_call(self.model, args, self.keywords))
        spec = self.reweight
        if spec is None:
            return loss
        labels = args[self.keywords.index(spec.labels)]
        kept = labels[..., spec.shift:] if spec.shift else labels
        tokens = (kept != spec.ignore_index).sum()
        weighted = loss * tokens.to(loss.dtype) / args[self.keywords.index(spec.input)]
        return torch.where(tokens > 0, weighted, torch.zeros_like(weighted))


class _Inference(nn.Module):
    """forward(*inputs) -> model(*inputs), with the user's model under the same prefix."""

    def __init__(self, model: nn.Module, keywords=None):
        super().__init__()
        self.model = model
        self.keywords = keywords

    def forward(self, *args):
        return _call(self.model, args, self.keywords)


@contextmanager
def caches_off(model: nn.Module):
    """Switch off ``config.use_cache`` (transformers) while capturing: a training step keeps no cache.

    With the cache on, attention writes keys and values into a cache object (``detach_``, ``cat``,
    ``to``), which would sit inside every tensor-parallel region; the graph is captured once, so
    the program trains and infers without it. Logs one line when it switches a cache off.
    """
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and getattr(c, "use_cache", False) is True}
    for config in configs.values():
        config.use_cache = False
    if configs:
        log.info("capture: %s's use_cache switched off for capture and training (a training step keeps no cache)",
                 type(model).__name__)
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True


def _is_user_file(filename: str) -> bool:
    """False for generated code and for files of torch, autopar's compiler or the standard library."""
    if filename.startswith("<"):  # generated code (fx, exec)
        return False
    path = os.path.abspath(filename)
    # the packages' folders, found without importing them (autopar imports this module)
    compiler = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,) + tuple(
        os.path.abspath(folder) + os.sep
        for name in ("autopar", "autopar.ir", "autopar.ops", "autopar.passes", "autopar.runtime")
        for folder in importlib.util.find_spec(name).submodule_search_locations)
    paths = sysconfig.get_paths()
    installed = tuple(os.path.abspath(paths[k]) + os.sep for k in ("purelib", "platlib"))
    in_stdlib = path.startswith(os.path.abspath(paths["stdlib"]) + os.sep) and not path.startswith(installed)
    return not path.startswith(compiler) and not in_stdlib


def _user_frame(exc: BaseException) -> str | None:
    """The innermost traceback frame of real source outside torch, the stdlib and autopar's compiler."""
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if _is_user_file(f.filename)]
    if not user:
        return None
    frame = user[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}: {frame.line}"


def _capture_error(model: nn.Module, mode: str, exc: Exception) -> CaptureError:
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    where = _user_frame(exc) or f"model {type(model).__name__}"
    other = "symbolic_trace" if mode == "export" else "export"
    text = f"{type(exc).__name__}: {first_line}"
    if "control flow" in text or "data-dependent" in text or "DataDependent" in text:
        remedy = ("remove data-dependent Python control flow at that line (use torch.where / torch.cond), "
                  "turn off caches that return Python objects")
    else:
        remedy = "rewrite that line with plain torch ops the tracer can follow"
    return CaptureError(
        f"{mode} could not capture {type(model).__name__}: {text[:300]}",
        where=where,
        fix=f"{remedy}, or try capture='{other}'",
    )


class _BufferProxyTracer(fx.Tracer):
    """symbolic_trace that proxies buffers, so slicing a buffer by a traced size (rotary tables) works."""

    proxy_buffer_attributes = True


def _symbolic_trace(model: nn.Module) -> fx.GraphModule:
    graph = _BufferProxyTracer().trace(model)
    return fx.GraphModule(model, graph, class_name=type(model).__name__)


#: calls export writes that compute nothing: metadata assertions, and the runtime asserts and range
#: constraints of symbolic sizes (a batch's dims are checked against the plan's range before any graph runs)
_DROPPED = frozenset(getattr(torch.ops.aten, name).default for name in (
    "_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range", "sym_constrain_range_for_size")
    if hasattr(torch.ops.aten, name))


def _clean(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop export's guard call, its metadata assertions and pytree codegen: plain positional code.

    ``aten._assert_tensor_metadata`` (export writes one before every ``.to``) computes nothing and
    checks only dtype, device and layout, which the pass manager re-checks after every pass; kept, it
    would pin the device the model was traced on and stop tensor parallelism at every ``.to``.
    """
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
        elif node.op == "call_function" and node.target in _DROPPED:
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm.graph._codegen = fx.graph.CodeGen()
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _is_meta_capture(root: nn.Module, args: tuple) -> bool:
    tensors = list(root.parameters()) + list(root.buffers()) + [a for a in args if isinstance(a, torch.Tensor)]
    return any(t.is_meta for t in tensors)


@contextmanager
def _on_fake_cpu(root: nn.Module, args: tuple):
    """Trace a meta-device model on fake CPU tensors: the code then takes the CPU branches.

    Meta tensors carry no device of their own to run on: code that asks ``x.device.type`` (HF
    Mixtral's router loss picks its histogram dtype so) would bake choices no real device makes.
    Every parameter, buffer and input becomes a fake CPU tensor of the same shape, stride and
    dtype for the trace; nothing is allocated. Yields the fake arguments.
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(t: torch.Tensor) -> torch.Tensor:
        value = to_fake(t, mode)
        return nn.Parameter(value, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else value

    state = {**dict(root.named_parameters()), **dict(root.named_buffers())}  # one name per tensor: ties kept
    with _reparametrize_module(root, {k: fake(v) for k, v in state.items()}, tie_weights=True):
        yield tuple(to_fake(a, mode) if isinstance(a, torch.Tensor) else a for a in args)


def _restore_meta(gm: fx.GraphModule, root: nn.Module) -> None:
    """Put the model's own (meta) tensors back where the fake trace left fake ones."""
    originals = {**dict(root.named_parameters(remove_duplicate=False)),
                 **dict(root.named_buffers(remove_duplicate=False))}
    for module_name, module in list(gm.named_modules()):
        for attr, value in list(vars(module).items()) + list(module._parameters.items()) + list(
                module._buffers.items()):
            if not isinstance(value, FakeTensor):
                continue
            name = f"{module_name}.{attr}" if module_name else attr
            original = originals.get(name)
            if original is None:  # a constant the trace lifted: its shape on meta
                original = torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype,
                                               device="meta")
            if attr in module._parameters:
                module._parameters[attr] = original if isinstance(original, nn.Parameter) else nn.Parameter(
                    original, requires_grad=value.requires_grad)
            elif attr in module._buffers:
                module._buffers[attr] = original
            else:
                setattr(module, attr, original)


def _name_inputs(gm: fx.GraphModule, model: nn.Module, num_inputs: int, has_loss: bool, keywords=None):
    """Rename the placeholders after the model's forward parameters, or the batch's keys (and ``target``)."""
    try:
        params = list(keywords) if keywords else [p.name for p in inspect.signature(model.forward).parameters.values()
                                                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    wanted = (params + [f"input_{i}" for i in range(len(params), num_inputs)])[:num_inputs]
    wanted += ["target"] if has_loss else []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(wanted), (len(placeholders), wanted)
    for node, name in zip(placeholders, wanted):
        node.target = name
        node._rename(name)
    gm.recompile()
    return tuple(n.name for n in placeholders)


def capture(
    model: nn.Module,
    example_inputs: tuple,
    *,
    loss_fn=None,
    example_target: torch.Tensor | None = None,
    mode: str = "export",
    keywords: tuple[str, ...] | None = None,
    own_loss: bool = False,
    dynamic: Mapping[int, tuple[int, ...]] | None = None,
) -> CapturedGraph:
    """Trace ``model`` (and ``loss_fn`` when given) on ``example_inputs`` into an ATen GraphModule.

    ``keywords``: the names ``example_inputs`` are passed under (``model(**batch)``, a dict batch as
    HF data collators make it). ``own_loss``: no ``loss_fn``; the graph returns the loss the model
    computes itself (``output.loss``, for a batch carrying ``labels``). Caches are switched off
    while tracing (:func:`caches_off`). ``dynamic``: {position in ``example_inputs`` (the target
    after them): dims} to keep symbolic (passes/frontend/dynamic_capture.py); those that stay so are
    ``CapturedGraph.dynamic``.
    """
    if mode not in CAPTURE_MODES:
        raise CaptureError(f"unknown capture mode {mode!r}", where="compile(capture=...)",
                           fix=f"use one of {CAPTURE_MODES}")
    has_loss = loss_fn is not None
    if has_loss and example_target is None:
        raise CaptureError("a loss_fn was given without an example target", where="capture",
                           fix="pass example_target= (a batch of targets) with loss_fn")
    count = _item_count(model, keywords) if own_loss else None
    if count is not None:  # one more keyword input, after the batch's (passes/frontend/item_count.py)
        keywords = tuple(keywords) + (count.input,)
        example_inputs = tuple(example_inputs) + (_example_count(example_inputs),)
    args = tuple(example_inputs) + ((example_target,) if has_loss else ())
    # distinct tensors for distinct inputs: export merges inputs that are the same object
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    marks = _marks(dynamic, num_user=len(example_inputs) - (count is not None), added=count is not None)
    try:
        with caches_off(model):
            traced = _symbolic_trace(model) if mode == "symbolic_trace" else model
            root = (_WithLoss(traced, loss_fn, keywords) if has_loss else
                    _ModelLoss(traced, keywords) if own_loss else _Inference(traced, keywords))
            gm, out_spec, ranges = _export(root, args, marks)
            names = _name_inputs(gm, model, len(example_inputs), has_loss, keywords)
            if count is not None and not _count_read(gm, names, keywords):
                log.info("capture: %s takes %s but its loss does not read it (a mean over each call's label "
                         "tokens): captured again with the loss weighted by its tokens over the step's count",
                         type(model).__name__, NUM_ITEMS)
                gm, out_spec, ranges = _export(_ModelLoss(traced, keywords, reweight=count), args, marks)
                names = _name_inputs(gm, model, len(example_inputs), has_loss, keywords)
    except CaptureError:
        raise
    except Exception as exc:  # noqa: BLE001 - every tracer failure becomes a CaptureError
        raise _capture_error(model, mode, exc) from exc
    extra = ()
    if count is not None:
        count, names = _read_count(gm, count, names, keywords, model)
        keywords = keywords[:-1]
        extra = (example_inputs[-1],) if count is not None else ()
    symbolic = read_dynamic_dims(gm, ranges) if marks else ()
    log.info("captured %s with %s: %d nodes%s", type(model).__name__, mode, len(gm.graph.nodes),
             "".join(f"; {d.describe()} symbolic" for d in symbolic))
    return CapturedGraph(gm=gm, input_names=names, out_spec=out_spec,
                         has_loss=has_loss or own_loss, mode=mode, keywords=keywords, has_target=has_loss,
                         item_count=count, extra_args=extra, dynamic=symbolic)


def _marks(dynamic, *, num_user: int, added: bool) -> dict[int, tuple[int, ...]]:
    """``dynamic`` (positions in the user's inputs, the target after them) as positions in export's
    arguments, where capture's count input follows the user's inputs."""
    if not dynamic:
        return {}
    return {(i + 1 if added and i >= num_user else i): tuple(dims) for i, dims in dynamic.items() if dims}


def _item_count(model: nn.Module, keywords) -> ItemCount | None:
    if NUM_ITEMS in keywords:
        raise CaptureError(f"the batch carries {NUM_ITEMS!r}: autopar counts the step's label tokens itself",
                           where=f"example_inputs[{NUM_ITEMS!r}]",
                           fix=f"drop {NUM_ITEMS!r} from the batch: every step counts the labels of all its "
                               "microbatches and dp ranks and passes the count to the model")
    return item_count_spec(model, keywords)


def _example_count(example_inputs: tuple) -> torch.Tensor:
    """The count's example value (any positive number: the graph only divides by it), on the batch's device."""
    return torch.ones((), dtype=torch.float32, device=example_inputs[0].device)


def _export(root: nn.Module, args: tuple, marks=None) -> tuple[fx.GraphModule, pytree.TreeSpec, dict]:
    """torch.export of ``root`` on ``args`` (fake CPU tensors for a meta model), cleaned: (graph, output
    spec, {symbol: (low, high)} of the dims ``marks`` kept symbolic)."""
    on_meta = _is_meta_capture(root, args)
    shapes = export_dynamic_shapes(len(args), marks) if marks else None
    if on_meta:
        with _on_fake_cpu(root, args) as fake_args:
            exported = torch.export.export(root, fake_args, strict=False, dynamic_shapes=shapes)
    else:
        exported = torch.export.export(root, args, strict=False, dynamic_shapes=shapes)
    gm = exported.module()
    if on_meta:
        _restore_meta(gm, root)
    gm = _clean(gm)
    # a model traced on meta bakes device=meta into the graph: the graph runs wherever its tensors are
    retarget_devices(gm, source=torch.device("meta"), target=torch.device("cpu"))
    return gm, exported.call_spec.out_spec, export_ranges(exported) if marks else {}


def _count_placeholder(gm: fx.GraphModule, names: tuple, keywords: tuple) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == names[len(keywords) - 1])


def _count_read(gm: fx.GraphModule, names: tuple, keywords: tuple) -> bool:
    return bool(_count_placeholder(gm, names, keywords).users)


def _read_count(gm: fx.GraphModule, count: ItemCount, names: tuple, keywords: tuple, model: nn.Module):
    """(the count spec with the graph's input names, the input names); (None, names less it) when the
    captured loss never reads the count (an output that is no loss of its own tokens): that input is dropped."""
    node = _count_placeholder(gm, names, keywords)
    if not node.users:
        log.info("capture: %s takes %s but the graph does not read it", type(model).__name__, NUM_ITEMS)
        gm.graph.erase_node(node)
        gm.recompile()
        return None, tuple(n for n in names if n != node.name)
    labels = names[keywords.index(count.labels)]
    shift = count.shift
    if count.labels == LABELS and not shift and _loss_shifts_in_graph(gm, labels):
        log.info("capture: %s's loss predicts labels[..., 1:] (its graph slices them): %s counts them so",
                 type(model).__name__, NUM_ITEMS)
        shift = 1
    return ItemCount(labels=labels, shift=shift, ignore_index=count.ignore_index, input=node.name), names


aten = torch.ops.aten

#: ops a loss moves its labels through unchanged but for their layout (the pad and slice of a shift)
_LABEL_LAYOUT_OPS = frozenset({aten.pad, aten.constant_pad_nd, aten.slice, aten.view, aten.reshape, aten._unsafe_view,
                               aten.clone, aten.contiguous, aten.alias, aten._to_copy, aten.to})


def _loss_shifts_in_graph(gm: fx.GraphModule, labels: str) -> bool:
    """Whether the labels reach the loss through a slice of their last dim from 1 (``labels[..., 1:]``).

    transformers.Trainer decides the shift from ``loss_type``, which a model whose class name matches
    no loss (GPT2LMHeadModel) leaves None although its forward calls ``loss_function``, whose fallback
    is the causal LM loss, which shifts: there the count over unshifted labels would divide the sum of
    ``labels[..., 1:]`` by one token per row too many. The graph says what the loss does.
    """
    node = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.name == labels), None)
    if node is None:
        return False
    seen, todo = set(), [node]
    while todo:
        current = todo.pop()
        for user in current.users:
            if user in seen or getattr(user.target, "overloadpacket", None) not in _LABEL_LAYOUT_OPS:
                continue
            seen.add(user)
            value = current.meta.get("val")
            if user.target is aten.slice.Tensor and user.args[0] is current and hasattr(value, "dim"):
                dim = user.args[1] if len(user.args) > 1 else 0
                start = user.args[2] if len(user.args) > 2 else None
                if dim in (value.dim() - 1, -1) and start == 1:
                    return True
            todo.append(user)
    return False
