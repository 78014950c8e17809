"""CPU stand-ins for the ``mint`` ops that MindSpore ONE's models call and MindSpore 2.10 has no
CPU kernel for.

On CPU, the first call of each of these fails inside MindSpore's kernel selection (pyboost's
``SelectKernel``) with the error named in its entry below; Llama, Qwen2 and Qwen2-VL from
``mindone.transformers`` all hit several of them. Each stand-in computes the same thing with the
older ``ops`` primitive that does have a CPU kernel (forward, backward and under ``jit``).

The choice is made where the op is used, not where the stand-ins are installed: :func:`apply`
puts them in place as attributes of ``mindspore.mint``, ``mint.nn``, ``mint.nn.functional`` and
``mindspore.ops`` on every target, and each one asks, at every call (and, under
``mindspore.jit``, while the graph is compiled: a compiled graph holds one branch only), whether
MindSpore's device target is the CPU now (:func:`needed`, which reads the target afresh). Off
CPU it hands the call, arguments as given, to the original op. So a GPU or Ascend script that
imports ``graph_exec.models`` before it chooses its device runs the native ops on that device;
off CPU a pynative call of a replaced op costs one Python call and a read of the target more.
A stand-in refuses the arguments it does not implement (``embedding``'s ``max_norm`` and
``scale_grad_by_freq``, ``Conv3d``'s ``padding_mode`` and ``"same"`` padding) with an error
naming the value, instead of ignoring them.

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
from mindspore.common.generator import default_generator
from mindspore.graph.api import _run_in_jit
from mindspore.mint.nn import functional as mint_functional
from mindspore.ops.function.nn_func import generator_step_

from graph_exec.device import policy

#: ``ops.Dropout``'s seeds are int32 attributes.
_MAX_SEED = 2**31 - 1


def needed() -> bool:
    """Whether MindSpore's device target now lacks the kernels (it is the CPU)."""
    return policy().target == "CPU"


#: :func:`needed` as ``mindspore.jit`` sees it: a constant evaluated while a graph is compiled
#: (a ``constexpr``; a plain call in pynative), so a compiled stand-in holds only the branch of
#: its target and never selects a kernel the target lacks.
_on_cpu = ops.constexpr(needed, reuse_result=False)

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
    """``mint``'s dropout draws its mask from ``mindspore.default_generator`` (seed and offset,
    what checkpoints save); so does this stand-in in pynative: a fresh ``ops.Dropout`` seeded by
    the generator's ``(seed, offset)``, which it advances as ``mint``'s does, so a restored
    generator state gives the same masks. Under ``jit`` the generator's offset is a tensor and a
    primitive's seeds are constants, so there it is ``ops.dropout``, whose compiled kernel keeps
    a generator of its own (docs/restarts.md, "Resuming exactly")."""
    if not training or p == 0:
        return input
    if _run_in_jit():  # @jit.cond: True
        return ops.dropout(input, p=p, training=training)
    seed, offset = default_generator._step(generator_step_)
    seeds = _generator_seeds(int(seed), int(offset))
    return ops.Dropout(keep_prob=1.0 - p, Seed0=seeds[0], Seed1=seeds[1])(input)[0]


def _generator_seeds(seed: int, offset: int) -> tuple[int, int]:
    """``ops.Dropout``'s two seeds for a generator position: distinct per ``(seed, offset)``,
    never ``(0, 0)`` (which the kernel takes for "pick a random seed")."""
    return seed % _MAX_SEED, offset % (_MAX_SEED - 1) + 1


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
    """A row gather; rows of ``padding_idx`` tokens get no gradient, as the native op's.
    ``max_norm`` (renormalising the rows looked up) and ``scale_grad_by_freq`` are not
    implemented: refused (``norm_type`` matters only with ``max_norm``)."""
    if max_norm is not None:
        raise ValueError(
            f"embedding: max_norm={max_norm} is not implemented by graph_exec's CPU stand-in "
            "(MindSpore 2.10 has no CPU Embedding kernel); use max_norm=None"
        )
    if scale_grad_by_freq:
        raise ValueError(
            f"embedding: scale_grad_by_freq={scale_grad_by_freq} is not implemented by graph_exec's "
            "CPU stand-in (MindSpore 2.10 has no CPU Embedding kernel); use scale_grad_by_freq=False"
        )
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
# Each overrides ``construct`` only (same parameters and attributes as the original class, which
# it subclasses): off CPU it is the original's.


class Embedding(nn.EmbeddingExt):
    """``mint.nn.Embedding`` through :func:`embedding` (kernel ``Embedding``) on CPU."""

    def construct(self, input: Tensor) -> Tensor:
        if not _on_cpu():
            return super().construct(input)
        return embedding(
            input, self.weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq
        )


class LayerNorm(nn.LayerNormExt):
    """``mint.nn.LayerNorm`` through the ``LayerNorm`` primitive (kernel mod ``LayerNormExt``)
    on CPU."""

    def construct(self, input: Tensor) -> Tensor:
        if not _on_cpu():
            return super().construct(input)
        axis = -len(self.normalized_shape)
        layer_norm = ops.LayerNorm(axis, axis, self.eps)
        if self.weight is None:
            weight = ops.ones(self.normalized_shape, input.dtype)
            bias = ops.zeros(self.normalized_shape, input.dtype)
            return layer_norm(input, weight, bias)[0]
        bias = ops.zeros_like(self.weight) if self.bias is None else self.bias
        return layer_norm(input, self.weight, bias)[0]


class Conv3d(mint.nn.Conv3d):
    """``mint.nn.Conv3d`` through ``ops.conv3d`` (kernel ``Conv3DExt``) on CPU: zero padding
    given as numbers or ``"valid"``; another ``padding_mode`` or ``padding="same"`` is refused."""

    def construct(self, input: Tensor) -> Tensor:
        if not _on_cpu():
            return super().construct(input)
        if self.padding_mode != "zeros":
            raise ValueError(
                f"Conv3d: padding_mode={self.padding_mode!r} is not implemented by graph_exec's CPU "
                "stand-in (MindSpore 2.10 has no CPU Conv3DExt kernel); use padding_mode='zeros'"
            )
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
    if isinstance(padding, str):
        if padding != "valid":
            raise ValueError(
                f"Conv3d: padding={padding!r} is not implemented by graph_exec's CPU stand-in "
                "(MindSpore 2.10 has no CPU Conv3DExt kernel); use 'valid' or numbers"
            )
        return (0, 0, 0)
    if isinstance(padding, int):
        return (padding,) * 3
    return tuple(padding)


# -- the table ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Replacement:
    """``owner.name`` is ``stand_in`` on CPU; ``error`` is what the original raises there."""

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


def _dispatching(stand_in: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    """A function that calls ``stand_in`` on CPU and ``original`` elsewhere, deciding at each
    call (at compile time under ``mindspore.jit``, which parses this function's source).
    Not ``functools.wraps``: ``jit`` follows ``__wrapped__`` and would compile the stand-in
    alone."""

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        if _on_cpu():
            return stand_in(*args, **kwargs)
        return original(*args, **kwargs)

    dispatch.__name__ = stand_in.__name__
    dispatch.__qualname__ = stand_in.__qualname__
    dispatch.__doc__ = f"On CPU :func:`{stand_in.__module__}.{stand_in.__name__}`, else the original op."
    return dispatch


def apply() -> None:
    """Install every stand-in (idempotent). On any target: each decides at its use whether the
    target is the CPU (a layer is its own class, a function a dispatcher to the original)."""
    for r in REPLACEMENTS:
        key = (id(r.owner), r.name)
        if key in _originals:
            continue
        original = getattr(r.owner, r.name)
        _originals[key] = original
        if isinstance(original, type):
            setattr(r.owner, r.name, r.stand_in)
        else:
            setattr(r.owner, r.name, _dispatching(r.stand_in, original))


def applied() -> bool:
    return bool(_originals)


def original(r: Replacement) -> Any:
    """What ``r.owner.r.name`` was before :func:`apply` (``KeyError`` before it)."""
    return _originals[(id(r.owner), r.name)]


def _layer_classes() -> Iterator[tuple[type, type]]:
    """``(original class, stand-in)`` for every replaced layer."""
    for r in REPLACEMENTS:
        replaced = _originals.get((id(r.owner), r.name))
        if isinstance(replaced, type):
            yield replaced, r.stand_in  # type: ignore[misc]


def adopt(cell: nn.Cell) -> int:
    """Turn every layer of ``cell`` built from a replaced class into its stand-in (same
    parameters, same attributes: the stand-ins only override ``construct``, and off CPU call
    the original's); returns how many."""
    apply()
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


__all__ = ["REPLACEMENTS", "Replacement", "adopt", "applied", "apply", "describe", "needed", "original"]
