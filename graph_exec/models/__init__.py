"""Real models from MindSpore ONE (``mindone.transformers``) cut into pipeline stages.

``pip install -e '.[models]'`` (from a clone) brings the pinned ``mindone`` and ``transformers``.
Import this package before ``mindone``: it first installs the stand-ins for the ``mint`` ops that
have no CPU kernel in MindSpore 2.10 (:mod:`graph_exec.models.cpu_ops`). Each decides where it is
used, from MindSpore's device target then: on CPU it computes with ``ops`` primitives, elsewhere
it calls the original op, so choosing the device before or after this import is the same. Then
build the model as usual and cut it::

    import graph_exec.models as gm

    model = gm.mindone().Qwen2VLForConditionalGeneration(config)  # mindone.transformers
    split = gm.split_model(model, num_stages=P * V)  # any images per sample, padded batches
    # split.preprocess, split.num_transpose_layers, split.stages: the schedules' arguments
    # gm.vlm_batch(split, samples): a batch; gm.causal_lm_loss: the loss_fn
    # gm.vlm_micro_batches(split, samples, M): M batches, each padded to its own sizes
    # gm.vlm_packed_micro_batches(split, samples, packing, L): packed rows (graph_exec.data.pack)
"""

from graph_exec.models import cpu_ops

cpu_ops.apply()

from graph_exec.balance import even_layers, rank_loads, rebalanced_layers  # noqa: E402
from graph_exec.models.export import export_pretrained  # noqa: E402
from graph_exec.models.inputs import image_patches, lm_inputs, vlm_inputs  # noqa: E402
from graph_exec.models.loss import IGNORE_INDEX, causal_lm_loss, causal_lm_token_loss  # noqa: E402
from graph_exec.models.materialise import load_split  # noqa: E402
from graph_exec.models.packed_batch import (  # noqa: E402
    text_packed_micro_batches,
    text_sample_costs,
    vlm_packed_micro_batches,
    vlm_sample_costs,
)
from graph_exec.models.pretrained import model_class  # noqa: E402
from graph_exec.models.quiet import quiet_imports  # noqa: E402
from graph_exec.models.split import SplitModel, split_model  # noqa: E402
from graph_exec.models.vlm_batch import VLMBatch, vlm_batch, vlm_micro_batches, vlm_tower_costs  # noqa: E402


def mindone():  # -> the mindone.transformers module
    """``mindone.transformers``, imported after the CPU stand-ins are in place (importing it
    first would bind the kernel-less ``mint.nn.LayerNorm`` into Qwen2-VL's module)."""
    cpu_ops.apply()
    with quiet_imports():
        import mindone.transformers

    return mindone.transformers


__all__ = [
    "IGNORE_INDEX",
    "SplitModel",
    "VLMBatch",
    "causal_lm_loss",
    "causal_lm_token_loss",
    "cpu_ops",
    "even_layers",
    "export_pretrained",
    "image_patches",
    "lm_inputs",
    "load_split",
    "mindone",
    "model_class",
    "rank_loads",
    "rebalanced_layers",
    "split_model",
    "text_packed_micro_batches",
    "text_sample_costs",
    "vlm_batch",
    "vlm_inputs",
    "vlm_micro_batches",
    "vlm_packed_micro_batches",
    "vlm_sample_costs",
    "vlm_tower_costs",
]
