"""The parameter counts ``tune --config`` prices from a config equal the mindone models' own:
the 72 B Qwen2-VL built unallocated (``no_init_parameters``) and cut by ``split_model``, to the
parameter, per stage; and small Llama / Qwen2 / Qwen2-VL models built for real."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from mindspore.nn.utils import no_init_parameters

import graph_exec.models as gm
from graph_exec.config_sizes import model_shape, param_counts, preprocess_params, read_config, stage_params
from tests.models import mindone_models

CONFIGS = Path(__file__).parents[1] / "data" / "configs"


def _elements(cell) -> int:
    return sum(math.prod(p.shape) for p in cell.get_parameters())


def _check(model, config: dict, num_stages: int) -> None:
    shape = model_shape(config)
    assert _elements(model) == param_counts(shape).total
    split = gm.split_model(model, num_stages)
    assert [_elements(c) for c in split.stages] == stage_params(shape, num_stages)
    assert _elements(split.preprocess) == preprocess_params(shape)
    assert sum(math.prod(p.shape) for p in split.unplaced.values()) == param_counts(shape).unplaced


def test_the_72b_count_equals_the_model_built_unallocated() -> None:
    """Qwen2-VL-72B (the Hub config's sizes): 73,405,565,524 elements, every stage of P·V = 8
    as the split cuts them. The config's ``torch_dtype`` is dropped: mindone's ``.to(bfloat16)``
    of parameters without data crashes MindSpore 2.10, and the count does not depend on it."""
    from transformers import Qwen2VLConfig

    config = read_config(CONFIGS / "qwen2-vl-72b")
    built = {k: v for k, v in config.items() if k not in ("torch_dtype", "model_type")}
    with no_init_parameters():
        model = gm.mindone().Qwen2VLForConditionalGeneration(Qwen2VLConfig(**built))
    _check(model, config, 8)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen2vl"])
def test_the_formula_counts_small_models_built_for_real(name: str) -> None:
    model = mindone_models.whole(name, layers=3)
    config = json.loads(model.config.to_json_string())
    _check(model, config, 3)
