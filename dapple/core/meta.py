"""Materialising a model's meta-device tensors on a device: only those asked for, initialised, and checked."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import torch
from torch import Tensor, nn

InitFn = Callable[[nn.Module], None]  # called on each module holding a materialised tensor, under no_grad
CHUNK = 1 << 22  # elements per check of a tensor's sentinel values: a bounded temporary, whatever the tensor


def is_meta_model(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` lies on the meta device."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def reset_parameters(module: nn.Module) -> None:
    """``module.reset_parameters()`` where the module defines it (torch's own layers do)."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def default_init(model: nn.Module) -> InitFn:
    """What initialises a submodule of ``model`` when the caller gives no ``init_fn``: a transformers model's own
    per-module ``_init_weights`` (its initializer_range, norms at one, rotary tables computed), else
    :func:`reset_parameters`."""
    hf_init = getattr(model, "_init_weights", None)
    return hf_init if callable(hf_init) and hasattr(model, "config") else reset_parameters


def check_init_fn(init_fn: object) -> None:
    """TypeError unless ``init_fn`` is None or a callable taking a module."""
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"init_fn: expected a callable init_fn(module) or None (reset_parameters), "
                        f"got {type(init_fn).__name__}")


@dataclass
class Materialised:
    """What :func:`materialise` made real: ``real[id(meta tensor)]`` is its tensor on the device, and
    ``meta[id(real tensor)]`` the meta tensor it replaced (for :func:`release`)."""

    real: dict[int, Tensor] = field(default_factory=dict)
    meta: dict[int, Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors made real."""
        return sum(t.numel() * t.element_size() for t in self.real.values())


def tensor_names(model: nn.Module) -> dict[int, str]:
    """id(parameter or buffer) -> its first name in ``model`` (a tied one: where it is first reached)."""
    names: dict[int, str] = {}
    for name, t in itertools.chain(model.named_parameters(remove_duplicate=False),
                                   model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), name)
    return names


def _slots(module: nn.Module) -> Iterator[tuple[dict, str, Tensor]]:
    """(the dict holding it, its name, tensor) for every parameter and buffer ``module`` holds directly."""
    for table in (module._parameters, module._buffers):
        for name, t in table.items():
            if t is not None:
                yield table, name, t


def replace(holders: Iterable[nn.Module], mapping: dict[int, Tensor]) -> None:
    """Put ``mapping[id(t)]`` wherever one of ``holders`` (or their submodules) holds a parameter or buffer ``t``,
    in place: the model, its traced graph and the stage modules cut from it then share the new tensors."""
    seen: set[int] = set()
    for holder in holders:
        for m in holder.modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            for table, name, t in list(_slots(m)):
                if id(t) in mapping:
                    table[name] = mapping[id(t)]


def _empty_like(t: Tensor, device: torch.device) -> Tensor:
    """An uninitialised copy of meta tensor ``t`` on ``device`` (a Parameter stays one), filled with a sentinel
    that initialisation must overwrite: NaN, or an integer dtype's smallest value."""
    data = torch.empty(t.shape, dtype=t.dtype, device=device)
    if data.is_floating_point() or data.is_complex():
        data.fill_(float("nan"))
    elif data.dtype != torch.bool:
        data.fill_(torch.iinfo(data.dtype).min)
    return nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data


def _sentinel_left(t: Tensor, version: int) -> bool:
    """Whether initialisation left some of ``t`` as :func:`_empty_like` filled it (a bool tensor: untouched)."""
    if t.dtype == torch.bool:
        return t._version == version
    flat = t.detach().reshape(-1)
    for part in flat.split(CHUNK):
        left = part.isnan() if t.is_floating_point() or t.is_complex() else part == torch.iinfo(t.dtype).min
        if bool(left.any()):
            return True
    return False


def materialise(model: nn.Module, wanted: Iterable[Tensor], holders: Sequence[nn.Module], device: torch.device,
                init_fn: InitFn, *, where: str, fill: bool = False) -> Materialised:
    """Make the meta tensors ``wanted`` real on ``device`` wherever ``holders`` hold them, and initialise them by
    calling ``init_fn`` on each module of ``model`` that holds one directly (model order, under no_grad).

    A tensor ``init_fn`` leaves (partly) uninitialised is a ValueError naming it, unless ``fill``: then it gets
    small random values (profiling needs numbers, not these ones). ``init_fn`` may also assign a module a new
    tensor (a recomputed buffer), which is then moved to ``device`` if needed.
    """
    todo = {id(t): t for t in wanted if t.is_meta}
    out = Materialised()
    if not todo:
        return out
    names = tensor_names(model)
    for t in todo.values():
        out.real[id(t)] = _empty_like(t, device)
    versions = {id(r): r._version for r in out.real.values()}
    replace(holders, out.real)
    owners = [(name, m) for name, m in model.named_modules()
              if any(id(t) in versions for _, _, t in _slots(m))]
    first = dict(out.real)  # (alive until the holders are given what init_fn assigned instead)
    made = {id(r): old for old, r in out.real.items()}
    slots = {(id(m), name): made[id(t)] for _, m in owners for _, name, t in _slots(m) if id(t) in made}
    with torch.no_grad():
        for name, m in owners:
            try:
                init_fn(m)
            except Exception as e:
                raise RuntimeError(f"{where}: init_fn on module {name or '(the model)'!r} ({type(m).__name__}) "
                                   f"failed: {type(e).__name__}: {e}") from e
    left = set()
    for _, m in owners:  # tensors init_fn assigned in place of materialised ones (a recomputed buffer)
        for table, name, t in list(_slots(m)):
            old = slots.get((id(m), name))
            if old is None or t is out.real[old]:
                continue
            if t.is_meta:
                table[name] = out.real[old]
                left.add(old)
            else:
                out.real[old] = table[name] = _on(t, device)
    left.update(old for old, new in out.real.items()
                if id(new) in versions and _sentinel_left(new, versions[id(new)]))
    if left and not fill:
        raise ValueError(uninitialised_message(sorted(names.get(i, "?") for i in left), where))
    for i in left:
        _random_fill(out.real[i])
    replace(holders, {id(first[old]): new for old, new in out.real.items() if new is not first[old]})
    out.meta = {id(new): todo[old] for old, new in out.real.items()}
    return out


def _on(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``, a Parameter still one."""
    moved = t.to(device)
    if isinstance(t, nn.Parameter) and not isinstance(moved, nn.Parameter):
        moved = nn.Parameter(moved, requires_grad=t.requires_grad)
    return moved


def _random_fill(t: Tensor) -> None:
    """Small random values (floating point) or zeros: numbers to profile with."""
    with torch.no_grad():
        if t.is_floating_point() or t.is_complex():
            t.normal_(0.0, 0.02)
        else:
            t.zero_()


def release(done: Materialised, holders: Sequence[nn.Module]) -> None:
    """Put the meta tensors back in place of those :func:`materialise` made real, freeing their memory."""
    replace(holders, done.meta)
    done.real.clear()
    done.meta.clear()


def meta_left(module: nn.Module) -> list[str]:
    """Names of the meta tensors ``module`` still holds: parameters, buffers and plain tensor attributes."""
    out = []
    for prefix, m in module.named_modules():
        tensors = [(n, t) for _, n, t in _slots(m)]
        tensors += [(n, v) for n, v in vars(m).items() if isinstance(v, Tensor) and not n.startswith("_")]
        out += [f"{prefix}.{n}" if prefix else n for n, t in tensors if t.is_meta]
    return out


def uninitialised_message(names: list[str], where: str) -> str:
    """The error for tensors built on the meta device that nothing initialised."""
    few = ", ".join(repr(n) for n in names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
    return (f"{where}: {few} {'was' if len(names) == 1 else 'were'} built on the meta device and init_fn left "
            f"{'it' if len(names) == 1 else 'them'} (or part) uninitialised. init_fn(module) is called on each "
            f"module holding such a tensor, under torch.no_grad (default: reset_parameters(), or a transformers "
            f"model's _init_weights): pass an init_fn that sets these (a buffer computed in __init__, such as a "
            f"rotary inv_freq, must be computed again), or build the module holding them on a real device")
