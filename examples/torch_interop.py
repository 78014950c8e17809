"""Does PyTorch ``transformers`` read an export, and give the logits graph_exec gives?

Two halves, because PyTorch and MindSpore need not share an environment:

1. ``python -m graph_exec.examples.torch_interop reference EXPORT BATCH.npz`` (the MindSpore
   environment) loads ``EXPORT`` (a directory :func:`graph_exec.models.export_pretrained` or
   ``graph-exec export`` wrote) with :func:`graph_exec.models.load_split` into a two-stage
   pipeline, runs its ``evaluate()`` on a fixed batch of the tiny presets
   (:mod:`graph_exec.examples.llama`, :mod:`graph_exec.examples.qwen2vl`), and also loads it
   with mindone's ``from_pretrained``; it writes the batch (``input_ids``, and for Qwen2-VL
   ``pixel_values`` and ``image_grid_thw`` as the Hugging Face model takes them) and both sets
   of logits to ``BATCH.npz``.
2. ``python examples/torch_interop.py compare EXPORT BATCH.npz`` (any environment with
   ``torch`` and ``transformers``; imports no MindSpore) loads ``EXPORT`` with PyTorch
   ``transformers``' ``from_pretrained`` (float32, eager attention), runs the same batch and
   compares its logits with both, ``atol`` 1e-5. It prints the largest differences and exits 1
   when either is over the tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ATOL = 1e-5
ROWS = 4  #: the batch: 4 sequences, 2 micro-batches of 2


def reference(export: str | Path, out: str | Path) -> dict[str, np.ndarray]:
    """graph_exec's and mindone's logits of ``export`` on the fixed batch, written to ``out``."""
    import graph_exec as ge
    import graph_exec.models as gm
    from graph_exec.examples import llama, qwen2vl
    from graph_exec.models.pretrained import load_config, model_type_of

    vlm = model_type_of(load_config(export)) == "qwen2_vl"
    options = {"image_grid": qwen2vl.SIZES["tiny"].grid} if vlm else {}
    parts = gm.load_split(export, 2, **options)
    for cell in [*parts.stages, parts.preprocess]:
        cell.set_train(False)
    stages = [ge.PipelineStage(cell, k, 2) for k, cell in enumerate(parts.stages)]
    sched = ge.ScheduleMPipeTranspose(
        stages, 2, parts.preprocess, parts.num_transpose_layers, mode="pynative", loss_fn=gm.causal_lm_loss
    )
    inputs, _ = qwen2vl.batch(parts.model, 0, ROWS) if vlm else llama.batch(0, ROWS)
    mine = np.concatenate([x.asnumpy() for x in sched.evaluate(*inputs)])
    whole = gm.model_class(load_config(export)).from_pretrained(str(export), attn_implementation="eager")
    whole.set_train(False)
    if vlm:
        import mindspore as ms

        pixels, ids = inputs[0].asnumpy(), inputs[1].asnumpy()
        batch = {
            "input_ids": ids,
            "pixel_values": pixels.reshape(-1, pixels.shape[-1]),
            "image_grid_thw": np.tile(np.array(qwen2vl.SIZES["tiny"].grid, np.int64), (ids.shape[0], 1)),
        }
        theirs = whole(**{k: ms.Tensor(v) for k, v in batch.items()}).logits.asnumpy()
    else:
        batch = {"input_ids": inputs[0].asnumpy()}
        out_ = whole(inputs[0])
        theirs = (out_[0] if isinstance(out_, tuple) else out_.logits).asnumpy()
    result = {**batch, "logits_graph_exec": mine, "logits_mindone": theirs}
    np.savez(out, **result)
    return result


def compare(export: str | Path, batch_file: str | Path) -> dict[str, float]:
    """PyTorch ``transformers``' logits of ``export`` against the two in ``batch_file``:
    ``{"graph_exec": max |diff|, "mindone": max |diff|}``."""
    import torch
    import transformers

    config = json.loads((Path(export) / "config.json").read_text(encoding="utf-8"))
    cls = getattr(transformers, config["architectures"][0])
    model = cls.from_pretrained(str(export), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    stored = np.load(batch_file)
    # Token ids and grids as the int64 Hugging Face's models index with (MindSpore's are int32).
    feed = {
        k: torch.from_numpy(stored[k].astype(np.int64) if stored[k].dtype.kind == "i" else stored[k])
        for k in ("input_ids", "pixel_values", "image_grid_thw")
        if k in stored
    }
    with torch.no_grad():
        logits = model(**feed).logits.numpy()
    return {
        which: float(np.abs(logits - stored[f"logits_{which}"]).max()) for which in ("graph_exec", "mindone")
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torch_interop", description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("reference", "compare"))
    parser.add_argument("export", help="an export directory (config.json + safetensors)")
    parser.add_argument("batch", help="the .npz file the reference half writes and compare reads")
    args = parser.parse_args(argv)
    if args.what == "reference":
        from graph_exec.msenv import prepare_mindspore

        prepare_mindspore("CPU")
        result = reference(args.export, args.batch)
        shape = result["logits_graph_exec"].shape
        gap = float(np.abs(result["logits_graph_exec"] - result["logits_mindone"]).max())
        print(f"{args.export}: logits {list(shape)}, graph_exec vs mindone max |diff| {gap:.3g}")
        return 0
    diffs = compare(args.export, args.batch)
    ok = all(d <= ATOL for d in diffs.values())
    print(
        f"{args.export}: torch transformers vs graph_exec max |diff| {diffs['graph_exec']:.3g}, "
        f"vs mindone {diffs['mindone']:.3g} (atol {ATOL:g}): {'OK' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
