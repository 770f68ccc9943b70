"""``reshape`` of a tensor with symbolic sizes, recorded without guarding on a size being 1.

ATen's ``reshape`` (a C++ composite) asks whether its input is contiguous, and whether the new
shape can be a view of the old strides, with plain guards: a size that could be 1 or 0 gets a guard
(``Ne(s1 - 1, 1)`` for ``logits[:, :-1].reshape(-1, vocab)``, ``Ne(s0, 1)`` for the batch), so
a sequence of length 2 or a batch of one falls outside the program and compiles one of its own,
specialized to that size. While recording, :func:`size_oblivious_reshape` runs ``reshape`` of
symbolically sized tensors as the same three cases, decided size-obliviously (the tracer runs with
``backed_size_oblivious``: a size symbol is taken for >= 2 where that avoids a guard): a view when
the input is contiguous or the new shape fits its strides for every size, otherwise a contiguous
copy viewed in the new shape (``clone`` + ``_unsafe_view``, what ATen records). The copy is
correct for every size; only for the sizes where ATen could have viewed does the program copy
instead (``reshape`` promises neither). Statically sized tensors take ATen's own kernel.
"""

from __future__ import annotations

import contextlib

import torch
from torch._C import DispatchKey
from torch._prims_common import infer_size, is_contiguous_or_false
from torch._subclasses.fake_impls import _compute_stride

aten = torch.ops.aten
_COMPOSITE = DispatchKey.CompositeImplicitAutograd


def _reshape(a: torch.Tensor, shape):
    if not any(isinstance(s, torch.SymInt) for s in (*a.shape, *a.stride(), *shape)):
        return aten.reshape.default._op_dk(_COMPOSITE, a, shape)  # ATen's own
    if is_contiguous_or_false(a):
        return aten.view.default(a, shape)  # as ATen: the proposed shape, -1 and all
    shape = infer_size(shape, a.numel())
    if _compute_stride(a.shape, a.stride(), shape, size_oblivious=True) is not None:
        return aten.view.default(a, shape)
    return aten._unsafe_view.default(aten.clone.default(a, memory_format=torch.contiguous_format),
                                     shape)


@contextlib.contextmanager
def size_oblivious_reshape():
    """While recording (symbolic make_fx runs the Python dispatcher): ``aten.reshape`` as above."""
    op = aten.reshape.default
    if _COMPOSITE in op.py_kernels:  # already on (or torch registered its own): leave it
        yield
        return
    op.py_kernels[_COMPOSITE] = _reshape
    op._dispatch_cache.clear()
    try:
        yield
    finally:
        del op.py_kernels[_COMPOSITE]
        op._dispatch_cache.clear()
