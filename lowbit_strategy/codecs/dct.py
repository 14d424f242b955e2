"""Chunked orthonormal DCT-II of a tensor: DeMo's transform (Peng, Quesnelle, Kingma, "DeMo:
Decoupled Momentum Optimization", arXiv:2411.19870, Sec. 3.1: "we split the momentum into chunks
and apply the DCT to each, as JPEG does to 8x8 blocks").

* **Chunks.** Along each dimension the chunk is the largest divisor of the dimension that is at
  most the target (:func:`chunk_size`; DeMo's rule: 768 with target 64 -> 64, 50 -> 50, 97 -> 1).
  A matrix of ``R x C`` splits into ``(R/r)·(C/c)`` chunks of ``r x c``; a vector of ``n`` into
  ``n/c`` chunks of ``c``. A tensor of more dimensions is read as the matrix
  ``shape[0] x prod(shape[1:])`` (a convolution's filters: output channels by everything else;
  DeMo's published code handles only matrices and vectors); a scalar as a vector of one.
* **The transform** of a chunk is the orthonormal DCT-II along each of its dimensions,
  ``Y = F_rᵀ X F_c`` with ``F[j, k] = s_k cos(π (2j + 1) k / 2n)``, ``s_0 = √(1/n)``,
  ``s_k = √(2/n)``; its inverse is ``X = F_r Y F_cᵀ`` (orthonormal: the transpose). The
  matrices are computed in float64 and rounded once to the data's dtype; the products are
  batched matmuls over all chunks of a tensor (few launches on a GPU).
* **Layout of coefficients:** ``(chunks, r·c)``, chunks in row-major order of their position
  (chunk row, then chunk column), coefficients row-major inside the chunk (``k_r·c + k_c``):
  DeMo's order, so the top-k indices mean the same thing.

Pure tensor code: no process group, nothing read on the host.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["ChunkDCT", "chunk_shape", "chunk_size", "dct_matrix"]


def chunk_size(n: int, target: int) -> int:
    """The largest divisor of ``n`` that is at most ``target`` (``n`` itself when ``n ≤ target``)."""
    if n <= target:
        return max(n, 1)
    best = 1
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            for c in (d, n // d):
                if best < c <= target:
                    best = c
    return best


@functools.lru_cache(maxsize=64)
def _dct64(n: int) -> torch.Tensor:
    j = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    k = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    scale = torch.full((1, n), math.sqrt(2.0 / n), dtype=torch.float64)
    scale[0, 0] = math.sqrt(1.0 / n)
    return scale * torch.cos(math.pi * (2 * j + 1) * k / (2 * n))


def dct_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """``F`` (``n x n``): column k is the k-th orthonormal DCT-II basis vector, so ``x @ F`` is
    the DCT of the rows of ``x`` and ``y @ F.T`` its inverse."""
    return _dct64(n).to(device=device, dtype=dtype)


def chunk_shape(shape: tuple[int, ...], target: int) -> tuple[tuple[int, int], int, int]:
    """``((r, c), rows, cols)``: the chunk of a tensor of ``shape`` and the matrix it is read as
    (``rows = 1`` and ``r = 1`` for a vector or a scalar; module docstring)."""
    numel = math.prod(shape)
    if len(shape) >= 2:
        rows, cols = shape[0], numel // max(shape[0], 1)
        return (chunk_size(rows, target), chunk_size(cols, target)), rows, cols
    return (1, chunk_size(numel, target)), 1, numel


class ChunkDCT:
    """The chunked DCT of tensors of one shape (module docstring).

    shape: the tensor's shape; target: the chunk target (DeMo's ``compression_chunk``).
    Attributes: ``rows x cols`` (the matrix it is read as; ``rows = 1`` for a vector),
    ``chunk`` ``(r, c)``, ``chunks`` (how many), ``size`` (``r·c``, coefficients per chunk).
    """

    def __init__(self, shape: torch.Size | tuple[int, ...], target: int, device, dtype=torch.float32):
        self.shape = tuple(shape)
        numel = math.prod(self.shape)
        (r, c), self.rows, self.cols = chunk_shape(self.shape, target)
        self.matrix = len(self.shape) >= 2
        self.chunk = (r, c)
        self.chunks = (self.rows // r) * (self.cols // c) if numel else 0
        self.size = r * c
        self._fr = dct_matrix(r, dtype, device)  # (1 x 1, unused, for a vector)
        self._fc = dct_matrix(c, dtype, device)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` -> ``(chunks, r, c)`` (a copy, chunk order of the module docstring)."""
        r, c = self.chunk
        return x.reshape(self.rows // r, r, self.cols // c, c).permute(0, 2, 1, 3).reshape(-1, r, c)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The coefficients of ``x`` (this shape), ``(chunks, size)``."""
        if not self.matrix:
            return x.reshape(self.chunks, self.size) @ self._fc
        y = self._fr.T @ self._blocks(x) @ self._fc
        return y.reshape(self.chunks, self.size)

    def decode(self, coeffs: torch.Tensor) -> torch.Tensor:
        """The tensor (this shape) whose coefficients are ``coeffs`` ``(chunks, size)``."""
        if not self.matrix:
            return (coeffs @ self._fc.T).reshape(self.shape)
        r, c = self.chunk
        x = self._fr @ coeffs.reshape(-1, r, c) @ self._fc.T
        x = x.reshape(self.rows // r, self.cols // c, r, c).permute(0, 2, 1, 3)
        return x.reshape(self.shape)
