"""Selective activation recomputation: which ops' outputs a stage keeps (the rest runs again in its backward)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# matmuls, convolutions and attention: most of a forward's time and little of its memory; elementwise ops, norms
# and softmax are the opposite, so they are recomputed (torchtitan's "op" policy, Megatron's selective recompute)
_SAVED_NAMES = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_fused_attention_overrideable")
SAVED_OPS = frozenset(getattr(torch.ops.aten, n).default for n in _SAVED_NAMES if hasattr(torch.ops.aten, n))


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts() -> Any:
    """The contexts of a selective checkpoint (``checkpoint(fn, ..., use_reentrant=False,
    context_fn=selective_contexts)``): the outputs of :data:`SAVED_OPS` are kept, every other op runs again."""
    return create_selective_checkpoint_contexts(_policy)


class KeptBytes(TorchDispatchMode):
    """Within ``with``: the bytes of the storages that :data:`SAVED_OPS` produce (what a selective checkpoint keeps
    of the forward run inside it), each once; ``exclude``: storages not to count (parameters, buffers)."""

    def __init__(self, exclude: set[int]):
        super().__init__()
        self.exclude = exclude
        self.storages: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in SAVED_OPS:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                    s = t.untyped_storage()
                    if s.data_ptr() not in self.exclude:
                        self.storages[s.data_ptr()] = s.nbytes()
        return out

    @property
    def total(self) -> int:
        return sum(self.storages.values())
