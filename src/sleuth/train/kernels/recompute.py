"""Cheap activations rebuilt in backward instead of kept: the MLP's activation and product,
RMSNorm's float32 copy of its input and its output (and, through `Recipes`, train/attention.py's
repeated key/value heads and attention output).

    recompute_cheap_activations(model)     # once; returns how many modules it switched

Autograd keeps, for every decoder layer of a Llama-style model (measured on the default's SmolLM2
row of 1,342 tokens, docs/benchmarks.md "memory"):
- the gated MLP `down(act(gate(x)) * up(x))`: four intermediate-wide tensors, gate(x) (for act's
  backward), act(gate(x)) and up(x) (for the product's) and the product itself (for the weight
  gradient of down, or of its LoRA A): 0.5 GB of a bf16 row's 1.16 GB;
- RMSNorm: its input upcast to float32 (for the square and the scaling), twice per layer, and its
  output, which the LoRA A of the projections reading it keep (as the output projection's keeps
  the attention output).

act(gate) and the product are one elementwise pass each from gate and up, which stay kept; the
float32 copy is one cast from the bf16 input, and the norm's output one more norm of that input,
kept anyway: so they are dropped after forward and rebuilt in backward (a `saved_tensors_hooks`
pack that stores a recipe instead of the tensor). A norm's output is saved by the modules after it,
so each switched module's parent (the decoder layer) runs its forward inside one recipe scope. The
recomputation repeats the same operations on the same inputs, so the values, and every gradient,
are bit-identical; only what lives between forward and backward changes (per default row, all of
it rebuilt: 1.16 -> 0.59 GB in bf16, 2.10 -> 1.33 GB in float32; a few ms of elementwise work per
layer, and the measured step was no slower).

A module is switched only if it has the expected parts and its switched forward gives exactly the
original's output on a random input, so an architecture whose norm or MLP computes something else
(Gemma's 1 + weight, a fused gate_up projection) keeps its own forward. Not used together with
gradient checkpointing, which already recomputes whole layers through its own hooks.
"""

from __future__ import annotations

import contextlib
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks


class _Recipe:
    """What a pack hook stores instead of a tensor: how to rebuild it from tensors kept anyway."""

    __slots__ = ("build",)

    def __init__(self, build: Callable[[], torch.Tensor]) -> None:
        self.build = build


def _unpack(packed: Any) -> torch.Tensor:
    # Module-level on purpose: autograd holds the unpack hook until backward, and a closure here
    # would hold the very tensors the recipes replace.
    if isinstance(packed, _Recipe):
        with torch.no_grad():
            return packed.build()
    return packed


def _view_within(t: torch.Tensor, kept: torch.Tensor) -> tuple[int, ...] | None:
    """(storage offset relative to `kept`, sizes..., strides...) if `t` is `kept` or a view of it
    (a split piece, a 2-d reshape as a linear layer saves its input); else None. `kept` is contiguous."""
    if t.dtype != kept.dtype or t.untyped_storage().data_ptr() != kept.untyped_storage().data_ptr():
        return None
    offset = t.storage_offset() - kept.storage_offset()
    last = offset + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    if offset < 0 or t.numel() == 0 or last >= kept.numel():
        return None
    return (offset, *t.shape, *t.stride())


def _view_of(build: Callable[[], torch.Tensor], view: tuple[int, ...]) -> Callable[[], torch.Tensor]:
    offset, rest = view[0], view[1:]
    dims = len(rest) // 2
    return lambda: build().as_strided(rest[:dims], rest[dims:], offset)


class Recipes:
    """Pack hook: a tensor registered with a recipe is saved as the recipe; others as they are.

    One scope is open at a time per thread (`recipe_scope`): a switched module registers what it
    makes into the open one, so a tensor is replaced wherever it is saved inside the scope, also by
    the next module (a norm's output saved by the attention's and MLP's LoRA layers). Registration
    holds the tensor weakly: it lives as long as the forward needs it and no longer.

    Autograd keeps the pack hook (not only the unpack hook) with every tensor saved under it until
    backward, so the recipes are let go when the block ends: otherwise the hook itself would keep
    alive what their closures hold."""

    def __init__(self) -> None:
        self.entries: dict[int, list[tuple[weakref.ref[torch.Tensor], Callable[[], torch.Tensor]]]] = {}
        self._hooks = saved_tensors_hooks(self.pack, _unpack)

    def __enter__(self) -> Recipes:
        self._hooks.__enter__()
        _open().append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _open().remove(self)
        self._hooks.__exit__(*exc)
        self.entries.clear()

    def add(self, tensor: torch.Tensor, build: Callable[[], torch.Tensor]) -> None:
        """Save `tensor`, and any view of it, as `build()` (a new contiguous tensor, equal to it)."""
        if tensor.is_contiguous():  # what build() returns: views map onto it one to one
            key = tensor.untyped_storage().data_ptr()
            self.entries.setdefault(key, []).append((weakref.ref(tensor), build))

    def pack(self, tensor: torch.Tensor) -> Any:
        for ref, build in self.entries.get(tensor.untyped_storage().data_ptr(), ()):
            kept = ref()
            view = None if kept is None else _view_within(tensor, kept)
            if kept is None or view is None:  # gone (its memory reused), or another tensor there
                continue
            if view == (0, *kept.shape, *kept.stride()):
                return _Recipe(build)
            return _Recipe(_view_of(build, view))
        return tensor


_THREAD = threading.local()


def _open() -> list[Recipes]:
    if not hasattr(_THREAD, "scopes"):
        _THREAD.scopes = []
    return _THREAD.scopes


@contextlib.contextmanager
def recipe_scope() -> Iterator[Recipes]:
    """The Recipes scope open in this thread, else a new one for the block."""
    scopes = _open()
    if scopes:
        yield scopes[-1]
        return
    with Recipes() as recipes:
        yield recipes


def _scoped_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """A module's forward inside one recipe scope (the parent of switched modules: a decoder layer,
    so a norm's output is rebuilt where the modules after it save it)."""
    if not torch.is_grad_enabled():
        return self._unscoped_forward(*args, **kwargs)
    with recipe_scope():
        return self._unscoped_forward(*args, **kwargs)


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """down(act(gate(x)) * up(x)), keeping gate(x) and up(x) only."""
    gate, up = self.gate_proj(x), self.up_proj(x)
    if not torch.is_grad_enabled():
        return self.down_proj(self.act_fn(gate) * up)
    act, g, u = self.act_fn, gate.detach(), up.detach()
    with recipe_scope() as recipes:
        activated = act(gate)
        recipes.add(activated, lambda: act(g))
        product = activated * up
        recipes.add(product, lambda: act(g) * u)
        return self.down_proj(product)


def _rms_norm_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """weight * (x / rms(x)) in float32, cast back: Llama's RMSNorm, keeping x only: its float32
    upcast and its output (which the next layers' LoRA inputs save) are rebuilt from x."""
    upcast = x.to(torch.float32)
    if not torch.is_grad_enabled():
        return _rms_norm(self, upcast, x.dtype)
    kept, dtype = x.detach(), x.dtype
    with recipe_scope() as recipes:
        if upcast is not x:
            recipes.add(upcast, lambda: kept.to(torch.float32))
        out = _rms_norm(self, upcast, dtype)
        recipes.add(out, lambda: _rms_norm(self, kept.to(torch.float32), dtype))
        return out


def _rms_norm(self: Any, upcast: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    variance = upcast.pow(2).mean(-1, keepdim=True)
    return self.weight * (upcast * torch.rsqrt(variance + self.variance_epsilon)).to(dtype)


def _is_mlp(module: torch.nn.Module) -> bool:
    return all(isinstance(getattr(module, name, None), torch.nn.Module)
               for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def _is_rms_norm(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor)
            and weight.dim() == 1 and isinstance(getattr(module, "variance_epsilon", None), float))


def _mlp_width(module: torch.nn.Module) -> int | None:
    base = getattr(module.gate_proj, "base_layer", module.gate_proj)  # a PEFT LoRA layer wraps it
    return getattr(base, "in_features", None)


def _switch_if_exact(module: torch.nn.Module, forward: Callable[..., torch.Tensor], width: int | None) -> bool:
    """Give `module` the forward if it reproduces the original's output exactly on a random input
    of `width` features."""
    param = next(module.parameters(), None)
    if width is None or param is None:
        return False
    dtype = param.dtype if param.dtype.is_floating_point else torch.float32
    generator = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(1, 3, width, generator=generator).to(device=param.device, dtype=dtype)
    with torch.no_grad():
        expected = module(probe)
        lean = types.MethodType(forward, module)
        with torch.enable_grad():  # the switched path saves for backward only under grad
            got = lean(probe.requires_grad_())
    if not (isinstance(expected, torch.Tensor) and expected.dtype == got.dtype and torch.equal(expected, got)):
        return False
    module.forward = lean
    return True


def recompute_cheap_activations(model: torch.nn.Module) -> int:
    """Switch every Llama-style gated MLP and RMSNorm of `model` to recompute its cheap
    activations in backward (see the module docstring); returns how many were switched."""
    switched = 0
    parents: list[torch.nn.Module] = []
    for parent in list(model.modules()):
        for module in parent.children():
            if _is_mlp(module):
                done = _switch_if_exact(module, _mlp_forward, _mlp_width(module))
            elif _is_rms_norm(module):
                done = _switch_if_exact(module, _rms_norm_forward, int(module.weight.shape[0]))
            else:
                continue
            switched += done
            if done and all(parent is not p for p in parents):
                parents.append(parent)
    for parent in parents:  # one scope over each, so later modules' saves find the recipes
        parent._unscoped_forward = parent.forward
        parent.forward = types.MethodType(_scoped_forward, parent)
    return switched
