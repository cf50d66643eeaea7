"""An order-fixed `tl.dot` for Triton's CPU interpreter, so that the kernel tests' bitwise checks hold on any host.

The interpreter computes `tl.dot` with numpy's matmul, and OpenBLAS picks its matmul kernel by CPU (or by
`OPENBLAS_CORETYPE`): the FMA kernels (Haswell, Zen) round an element differently by its place in the tile, so a
row's bits then depend on how many rows the tile holds. On a GPU a tensor-core dot has a fixed reduction order per
tile shape, which is what the batch-invariant kernels rest on. This dot gives the interpreter the same property:
each output element is the accumulator plus its products summed in an order fixed by K, in float32 (or the
accumulator's dtype), with separately rounded multiplies and adds (numpy's ufuncs never fuse them). So an element
depends only on its own row and column and on K, never on the BLAS build, the CPU or the tile's other rows. Tests
that compare interpreted kernels bit for bit take the `ordered_dot` fixture (tests/conftest.py); the others compare
within float tolerances and keep numpy's faster matmul."""

from __future__ import annotations

import numpy as np


def ordered_dot(a: np.ndarray, b: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """acc + a @ b over the last two axes, the products summed in a fixed pairwise tree over k (k 2i with 2i + 1,
    then the pairs' sums likewise, zeros padding K to a power of two), then added to acc. a: [..., M, K],
    b: [..., K, N], acc: [..., M, N]. Every step is one elementwise numpy add over all the rows and columns at
    once, never a reduction (numpy sums pairwise or reorders its axes by shape in those), so an element's order of
    additions depends on K alone."""
    dtype = acc.dtype
    a_k = np.moveaxis(a.astype(dtype, copy=False), -1, 0)[..., :, None]  # [K, ..., M, 1]
    b_k = np.moveaxis(b.astype(dtype, copy=False), -2, 0)[..., None, :]  # [K, ..., 1, N]
    terms = a_k * b_k  # [K, ..., M, N]
    while terms.shape[0] > 1:
        if terms.shape[0] % 2:
            terms = np.concatenate((terms, np.zeros_like(terms[:1])))
        terms = terms[0::2] + terms[1::2]
    return acc + terms[0]


def install():
    """Replace the interpreter's `create_dot` (with TRITON_INTERPRET=1); returns the function that puts the
    shipped one back."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8 or not d.dtype.is_floating():
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)  # fp8 / integer dots: as shipped
        return interpreter.TensorHandle(ordered_dot(a.data, b.data, d.data), d.dtype.scalar)

    builder.create_dot = create_dot

    def restore() -> None:
        builder.create_dot = original

    return restore
