"""CPU stand-ins for the ``mint`` ops that MindSpore ONE's models call and MindSpore 2.10 has no
CPU kernel for.

On CPU, the first call of each of these fails inside MindSpore's kernel selection (pyboost's
``SelectKernel``) with the error named in its entry below; Llama, Qwen2 and Qwen2-VL from
``mindone.transformers`` all hit several of them. Each stand-in computes the same thing with the
older ``ops`` primitive that does have a CPU kernel (forward, backward and under ``jit``).
:func:`apply` installs them as attributes of ``mindspore.mint``, ``mint.nn``,
``mint.nn.functional`` and ``mindspore.ops`` only when :func:`graph_exec.device.policy` says the
target is CPU: on Ascend (and GPU) the native ops are used and nothing is touched.

Order matters once: ``mindone``'s Qwen2-VL module binds ``from mindspore.mint.nn import
LayerNorm`` when it is imported, and some of its cells call ``mint.arange`` while they are
built, so :func:`apply` must run before ``mindone`` is imported and the model built
(``import graph_exec.models`` does it). :func:`adopt` then also converts layer instances
built from the original classes anyway (for a model made before), in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from mindspore import Tensor, mint, nn, ops
from mindspore.mint.nn import functional as mint_functional

from graph_exec.device import policy

# -- functions ----------------------------------------------------------------------------------
# Plain ``def``s (jit parses a function's source; lambdas on a shared line fail to parse).


def arange(start: Any = 0, end: Any = None, step: Any = 1, *, dtype: Any = None) -> Tensor:
    return ops.arange(start, end, step, dtype=dtype)


def full(size: Any, fill_value: Any, *, dtype: Any = None) -> Tensor:
    return ops.full(tuple(size), fill_value, dtype=dtype)


def zeros_like(input: Tensor, *, dtype: Any = None) -> Tensor:
    return ops.zeros_like(input, dtype=dtype)


def ones_like(input: Tensor, *, dtype: Any = None) -> Tensor:
    return ops.ones_like(input, dtype=dtype)


def full_like(input: Tensor, fill_value: Any, *, dtype: Any = None) -> Tensor:
    return ops.full_like(input, fill_value, dtype=dtype)


def stack(tensors: Any, dim: int = 0) -> Tensor:
    return ops.stack(tensors, axis=dim)


def cumsum(input: Tensor, dim: int, dtype: Any = None) -> Tensor:
    return ops.cumsum(input, dim, dtype=dtype)


def outer(input: Tensor, vec2: Tensor) -> Tensor:
    return ops.outer(input, vec2)


def repeat_interleave(input: Tensor, repeats: Any, dim: Any = None, *, output_size: Any = None) -> Tensor:
    return ops.repeat_interleave(input, repeats, dim)


def pad(input: Tensor, pad: Any, mode: str = "constant", value: Any = None) -> Tensor:
    return ops.pad(input, pad, mode, value)


def gelu(input: Tensor, approximate: str = "none") -> Tensor:
    return ops.gelu(input, approximate)


def dropout(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    return ops.dropout(input, p=p, training=training)


def log_softmax(input: Tensor, dim: Any = None, *, dtype: Any = None) -> Tensor:
    x = input if dtype is None else input.astype(dtype)
    return ops.log_softmax(x, -1 if dim is None else dim)


def embedding(
    input: Tensor,
    weight: Tensor,
    padding_idx: Any = None,
    max_norm: Any = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
) -> Tensor:
    """A row gather; rows of ``padding_idx`` tokens get no gradient, as the native op's."""
    rows = ops.gather(weight, input, 0)
    if padding_idx is None:
        return rows
    keep = (input != padding_idx).astype(rows.dtype).expand_dims(-1)
    return rows * keep + ops.stop_gradient(rows) * (1 - keep)


def rms_norm(input: Tensor, gamma: Tensor, epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    """``(input * rstd * gamma, rstd)`` with ``rstd = 1 / sqrt(mean(input^2, -1) + epsilon)``."""
    rstd = ops.rsqrt(ops.mean(ops.square(input), -1, keep_dims=True) + epsilon)
    return input * rstd * gamma, rstd


# -- layers ---------------------------------------------------------------------------------------


class Embedding(nn.EmbeddingExt):
    """``mint.nn.Embedding`` through :func:`embedding` (kernel ``Embedding``)."""

    def construct(self, input: Tensor) -> Tensor:
        return embedding(input, self.weight, self.padding_idx)


class LayerNorm(nn.LayerNormExt):
    """``mint.nn.LayerNorm`` through the ``LayerNorm`` primitive (kernel mod ``LayerNormExt``)."""

    def construct(self, input: Tensor) -> Tensor:
        axis = -len(self.normalized_shape)
        layer_norm = ops.LayerNorm(axis, axis, self.eps)
        if self.weight is None:
            weight = ops.ones(self.normalized_shape, input.dtype)
            bias = ops.zeros(self.normalized_shape, input.dtype)
            return layer_norm(input, weight, bias)[0]
        bias = ops.zeros_like(self.weight) if self.bias is None else self.bias
        return layer_norm(input, self.weight, bias)[0]


class Conv3d(mint.nn.Conv3d):
    """``mint.nn.Conv3d`` through ``ops.conv3d`` (kernel ``Conv3DExt``); zero padding only."""

    def construct(self, input: Tensor) -> Tensor:
        out = ops.conv3d(
            input,
            self.weight,
            None,
            self.stride,
            "pad",
            _three(self.padding),
            self.dilation,
            self.groups,
        )
        if self.bias is not None:
            out = out + self.bias.reshape(1, -1, 1, 1, 1)
        return out


def _three(padding: Any) -> tuple[int, int, int]:
    """The layer's zero padding as the ``(d, h, w)`` that ``ops.conv3d`` takes."""
    if isinstance(padding, int):
        return (padding,) * 3
    return tuple(padding)


# -- the table ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Replacement:
    """``owner.name`` becomes ``stand_in`` on CPU; ``error`` is what the original raises there."""

    owner: Any
    name: str
    stand_in: Callable[..., Any]
    error: str

    @property
    def where(self) -> str:
        return f"{self.owner.__name__}.{self.name}"


REPLACEMENTS: tuple[Replacement, ...] = (
    Replacement(mint, "arange", arange, "RuntimeError: The kernel Arange unregistered."),
    Replacement(mint, "full", full, "RuntimeError: The kernel FillScalar unregistered."),
    Replacement(mint, "zeros_like", zeros_like, "RuntimeError: The kernel ZerosLikeExt unregistered."),
    Replacement(mint, "ones_like", ones_like, "RuntimeError: The kernel OnesLikeExt unregistered."),
    Replacement(mint, "full_like", full_like, "RuntimeError: The kernel FullLike unregistered."),
    Replacement(mint, "stack", stack, "RuntimeError: The kernel StackExt unregistered."),
    Replacement(mint, "cumsum", cumsum, "RuntimeError: The kernel CumsumExt unregistered."),
    Replacement(mint, "outer", outer, "RuntimeError: The kernel Outer unregistered."),
    Replacement(
        mint,
        "repeat_interleave",
        repeat_interleave,
        "RuntimeError: The kernel RepeatInterleaveTensor unregistered.",
    ),
    Replacement(mint_functional, "pad", pad, "RuntimeError: The kernel ConstantPadND unregistered."),
    Replacement(mint_functional, "gelu", gelu, "RuntimeError: The kernel GeluExt unregistered."),
    Replacement(
        mint_functional, "dropout", dropout, "RuntimeError: The kernel DropoutExt unregistered (p > 0)."
    ),
    Replacement(
        mint_functional, "log_softmax", log_softmax, "RuntimeError: The kernel LogSoftmaxExt unregistered."
    ),
    Replacement(mint_functional, "embedding", embedding, "RuntimeError: The kernel Embedding unregistered."),
    Replacement(ops, "rms_norm", rms_norm, "RuntimeError: The kernel RmsNorm unregistered."),
    Replacement(mint.nn, "Embedding", Embedding, "RuntimeError: The kernel Embedding unregistered."),
    Replacement(
        mint.nn, "LayerNorm", LayerNorm, "RuntimeError: Create kernelmod for op LayerNormExt failed."
    ),
    Replacement(mint.nn, "Conv3d", Conv3d, "RuntimeError: The kernel Conv3DExt unregistered."),
)

#: The original of every replaced attribute, by ``(owner, name)`` (filled by :func:`apply`).
_originals: dict[tuple[int, str], Any] = {}


def needed() -> bool:
    """Whether this process's device target lacks the kernels (it is the CPU)."""
    return policy().target == "CPU"


def apply() -> bool:
    """Install every stand-in when the target is CPU (idempotent); ``True`` if they are in place."""
    if not needed():
        return False
    for r in REPLACEMENTS:
        key = (id(r.owner), r.name)
        if key not in _originals:
            _originals[key] = getattr(r.owner, r.name)
            setattr(r.owner, r.name, r.stand_in)
    return True


def applied() -> bool:
    return bool(_originals)


def _layer_classes() -> Iterator[tuple[type, type]]:
    """``(original class, stand-in)`` for every replaced layer."""
    for r in REPLACEMENTS:
        original = _originals.get((id(r.owner), r.name))
        if isinstance(original, type):
            yield original, r.stand_in  # type: ignore[misc]


def adopt(cell: nn.Cell) -> int:
    """On CPU, turn every layer of ``cell`` built from a replaced class into its stand-in (same
    parameters, same attributes: the stand-ins only override ``construct``); returns how many."""
    if not apply():
        return 0
    pairs = dict(_layer_classes())
    changed = 0
    for _, sub in cell.cells_and_names():
        stand_in = pairs.get(type(sub))
        if stand_in is not None:
            sub.__class__ = stand_in
            changed += 1
    return changed


def describe() -> list[str]:
    """One line per replacement: where, and the error it avoids."""
    return [f"{r.where}: {r.error}" for r in REPLACEMENTS]


__all__ = ["REPLACEMENTS", "Replacement", "adopt", "applied", "apply", "describe", "needed"]
