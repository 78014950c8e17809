"""The next-token loss of a split causal LM's logits, written so that it compiles on CPU too."""

from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, ops

#: Label of positions that carry no loss (image tokens, prompt), as in Hugging Face.
IGNORE_INDEX = -100


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy of ``logits`` (B, S, V) against ``labels`` (B, S), already aligned
    (``labels[:, i]`` is the token after position ``i``), over the positions whose label is
    not negative (:data:`IGNORE_INDEX`).

    A one-hot product with ``log_softmax``, not ``ops.cross_entropy``: its ``GatherD`` has no
    gradient inside a compiled graph on CPU (``Bprop "GatherDGradV2"``), and ``mint``'s cross
    entropy has no CPU kernel at all.
    """
    total, count = causal_lm_token_loss(logits, labels)
    return total / ops.clip(count, 1.0, None)


def causal_lm_token_loss(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """``(summed cross-entropy, label count)`` of :func:`causal_lm_loss`'s positions: the
    ``loss_fn`` of ``loss_reduction="token"``, whose step loss is the mean over every labelled
    token of the global batch, however the samples fall into rows and micro-batches."""
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab).astype(ms.float32)
    target = labels.reshape(-1)
    valid = (target >= 0).astype(ms.float32)
    picked = ops.one_hot(
        ops.clip(target, 0, vocab - 1), vocab, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)
    )
    nll = -(ops.log_softmax(flat, -1) * picked).sum(-1)
    return (nll * valid).sum(), valid.sum()
