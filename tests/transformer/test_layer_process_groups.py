"""The NPU spec's layers (``NPUTransformerLayer``) build quietly and hand their MLP slot the
layer's process groups: Megatron's ``TransformerLayer`` logs "Unknown MLP type ... Using
default kwargs." for ``NPUMLP`` and builds it on parallel_state's global tensor-parallel group
instead of the model's ``pg_collection.tp``.

Real megatron-core, one gloo process on CPU; the model's own process groups are real gloo
groups (``torch.distributed.new_group``), distinct objects from parallel_state's.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from mcore_npu.transformer.layer import NPUTransformerLayer, mlp_process_group_keyword
from tests.transformer.megatron_models import VOCAB, batch, gpt, npu_spec, tiny_config
from tests.transformer.moe_models import moe_config, npu_moe_spec

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime")]

LINE = "Unknown MLP type"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def megatron_log():
    """Every line Megatron's transformer_layer logger emits while the test runs."""
    logger = logging.getLogger("megatron.core.transformer.transformer_layer")
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def _dense(layout):
    config = tiny_config()
    return config, npu_spec(config, param_layout=layout)


def _moe(layout, grouped=False):
    config = moe_config(moe_layer_freq=[1, 0], moe_grouped_gemm=grouped, shared_expert=True)
    return config, npu_moe_spec(config, param_layout=layout)


BUILDS = {
    "dense-local": lambda: _dense("local"),
    "dense-te": lambda: _dense("te"),
    "moe-and-dense-local": lambda: _moe("local"),
    "moe-and-dense-te-grouped": lambda: _moe("te", grouped=True),
}


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_building_a_model_logs_no_unknown_mlp_type(megatron_log, build):
    config, spec = BUILDS[build]()
    model = gpt(config, spec)
    assert all(type(layer) is NPUTransformerLayer for layer in model.decoder.layers)
    assert [line for line in megatron_log if LINE in line] == []


def test_megatrons_own_layer_logs_it_for_the_same_slot(megatron_log):
    """The capture sees the line: the same spec with Megatron's ``TransformerLayer``."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    config, spec = _dense("te")
    spec = copy.deepcopy(spec)
    spec.module = TransformerLayer
    gpt(config, spec)
    assert len([line for line in megatron_log if LINE in line]) == config.num_layers


def _own_process_groups():
    """The model's process groups: parallel_state's, with a tensor-parallel group of its own."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = ProcessGroupCollection.use_mpu_process_groups()
    groups.tp = dist.new_group([0], backend="gloo")
    return groups


def _model_on(groups, spec, config, seed=0):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(seed)
    return GPTModel(config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=64,
                    position_embedding_type="rope", pg_collection=groups)  # fmt: skip


@pytest.mark.parametrize("layout", ["local", "te"])
def test_dense_mlp_runs_on_the_models_tensor_parallel_group(layout):
    groups = _own_process_groups()
    config, spec = _dense(layout)
    model = _model_on(groups, spec, config)
    for layer in model.decoder.layers:
        assert type(layer.mlp).__name__ == "NPUMLP"
        assert layer.mlp.tp_group is groups.tp
        assert layer.mlp.linear_fc1.tp_group is groups.tp
        assert layer.mlp.linear_fc2.tp_group is groups.tp
    # Megatron's own layer with the same slot: parallel_state's group, not the model's
    from megatron.core.transformer.transformer_layer import TransformerLayer

    plain = copy.deepcopy(spec)
    plain.module = TransformerLayer
    lost = _model_on(groups, plain, config)
    assert all(layer.mlp.tp_group is not groups.tp for layer in lost.decoder.layers)
    # same numbers either way (one process: both groups have size 1)
    ids, pos = batch(b=2, s=8)
    torch.testing.assert_close(model(ids, pos, None), lost(ids, pos, None), rtol=0, atol=0)


def test_moe_layer_subclass_gets_the_process_group_collection(megatron_log):
    """A subclass of Megatron's ``MoELayer`` in the slot gets ``pg_collection``, as Megatron's
    own class does (with Megatron's layer it would get parallel_state's default groups)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    class SubclassedMoELayer(MoELayer):
        pass

    groups = _own_process_groups()
    config = moe_config()
    block = npu_moe_spec(config, param_layout="te")
    for layer_spec in block.layer_specs:
        layer_spec.submodules.mlp.module = SubclassedMoELayer
    model = _model_on(groups, block, config)
    for layer in model.decoder.layers:
        assert type(layer.mlp) is SubclassedMoELayer and layer.mlp.tp_group is groups.tp
        assert layer.mlp.shared_experts is None and layer.mlp.experts.ep_group is groups.ep
    assert [line for line in megatron_log if LINE in line] == []
    assert layer.submodules_config.mlp.module is SubclassedMoELayer  # the spec as given


def test_megatrons_own_classes_are_left_to_megatron():
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from mcore_npu.transformer.mlp import NPUMLP

    assert mlp_process_group_keyword(MLP) is None
    assert mlp_process_group_keyword(MoELayer) is None
    assert mlp_process_group_keyword(NPUMLP) == "tp_group"
    assert mlp_process_group_keyword(torch.nn.Linear) is None


def test_multi_token_prediction_layers_from_the_block_spec_are_quiet_too(megatron_log):
    """Megatron's MTP block spec from the NPU decoder-block spec: its layer is the block's last
    (``get_gpt_mtp_block_spec`` takes a block spec, or a single-layer spec only when its module
    is exactly ``TransformerLayer``: pass the block spec)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec

    config = tiny_config(mtp_num_layers=1)
    block = get_gpt_decoder_block_npu_spec(config, kernel="reference", param_layout="te",
                                           normalization=config.normalization)  # fmt: skip
    mtp = get_gpt_mtp_block_spec(config, block, use_transformer_engine=False)
    model = GPTModel(config, transformer_layer_spec=block, vocab_size=VOCAB,
                     max_sequence_length=64, position_embedding_type="rope",
                     mtp_block_spec=mtp)  # fmt: skip
    layer = model.mtp.layers[0].transformer_layer
    assert type(layer) is NPUTransformerLayer and type(layer.mlp).__name__ == "NPUMLP"
    assert [line for line in megatron_log if LINE in line] == []
