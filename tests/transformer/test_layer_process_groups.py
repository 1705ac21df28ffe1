"""The NPU spec's layers are Megatron's own ``TransformerLayer``; their MLP slot, when it holds
a subclass of Megatron's MLP / MoE classes (``NPUMLP``, ``NPUMoELayer``), is a
``BoundModuleSpec``: built without Megatron's "Unknown MLP type ... Using default kwargs." line,
on the process groups given to the spec builder (``pg_collection=``), else on parallel_state's.

Real megatron-core, one gloo process on CPU; the model's own process groups are real gloo
groups (``torch.distributed.new_group``), distinct objects from parallel_state's.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from mcore_npu.transformer.layer import (
    BoundModuleSpec,
    bind_mlp_process_groups,
    mlp_process_group_keyword,
)
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
    from megatron.core.transformer.transformer_layer import TransformerLayer

    config, spec = BUILDS[build]()
    model = gpt(config, spec)
    assert all(type(layer) is TransformerLayer for layer in model.decoder.layers)
    assert [line for line in megatron_log if LINE in line] == []


def test_megatron_logs_it_for_the_same_module_in_a_plain_module_spec(megatron_log):
    """The capture sees the line: the same slot as a ``ModuleSpec``. megatron-core 0.18+'s
    layer calls the slot itself (``MLP.as_mlp_submodule``) and logs no such line; there the
    plain spec builds too, ``NPUMLP`` on the layer's tensor-parallel group."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    config, spec = _dense("te")
    spec = copy.deepcopy(spec)
    bound = spec.submodules.mlp
    assert isinstance(bound, BoundModuleSpec) and bound.module.__name__ == "NPUMLP"
    spec.submodules.mlp = ModuleSpec(bound.module, bound.params, bound.submodules)
    model = gpt(config, spec)
    layer_calls_the_slot = hasattr(MLP, "as_mlp_submodule")
    lines = len([line for line in megatron_log if LINE in line])
    assert lines == (0 if layer_calls_the_slot else config.num_layers)
    assert all(type(layer.mlp).__name__ == "NPUMLP" for layer in model.decoder.layers)


def _tp_group_of(mlp):
    """The tensor-parallel group an MLP / MoE layer runs on: its ``tp_group`` where Megatron's
    class keeps one (megatron-core 0.16+); on 0.15, which keeps none, the group of its first
    linear (``MLP``) or its ``attn_tp_group`` (``MoELayer``)."""
    if hasattr(mlp, "tp_group"):
        return mlp.tp_group
    return mlp.linear_fc1.tp_group if hasattr(mlp, "linear_fc1") else mlp.attn_tp_group


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
def test_dense_mlp_runs_on_the_spec_builders_tensor_parallel_group(layout):
    from mcore_npu.transformer.layer_specs import get_gpt_layer_npu_spec

    groups = _own_process_groups()
    config = tiny_config()
    spec = dict(normalization=config.normalization, qk_layernorm=config.qk_layernorm,
                kernel="reference", param_layout=layout)  # fmt: skip
    model = _model_on(groups, get_gpt_layer_npu_spec(**spec, pg_collection=groups), config)
    for layer in model.decoder.layers:
        assert type(layer.mlp).__name__ == "NPUMLP"
        assert _tp_group_of(layer.mlp) is groups.tp
        assert layer.mlp.linear_fc1.tp_group is groups.tp
        assert layer.mlp.linear_fc2.tp_group is groups.tp
    # without pg_collection the spec's NPUMLP takes parallel_state's group; megatron-core
    # 0.18+'s layer calls the slot with the model's groups itself, as for its own MLP
    from megatron.core.transformer.mlp import MLP

    lost = _model_on(groups, get_gpt_layer_npu_spec(**spec), config)
    layer_calls_the_slot = hasattr(MLP, "as_mlp_submodule")
    assert all((_tp_group_of(layer.mlp) is groups.tp) == layer_calls_the_slot
               for layer in lost.decoder.layers)  # fmt: skip
    # same numbers either way (one process: both groups have size 1)
    ids, pos = batch(b=2, s=8)
    torch.testing.assert_close(model(ids, pos, None), lost(ids, pos, None), rtol=0, atol=0)


def test_moe_layer_subclass_gets_the_process_group_collection(megatron_log):
    """``NPUMoELayer`` (a subclass of Megatron's ``MoELayer``, the fused permute) gets the
    spec builder's ``pg_collection``, as Megatron's layer gives its own class the model's."""
    groups = _own_process_groups()
    config = moe_config()
    block = npu_moe_spec(config, param_layout="te", moe_permute_kernel="reference",
                         pg_collection=groups)  # fmt: skip
    model = _model_on(groups, block, config)
    for layer in model.decoder.layers:
        assert type(layer.mlp).__name__ == "NPUMoELayer" and _tp_group_of(layer.mlp) is groups.tp
        assert layer.mlp.experts.ep_group is groups.ep
    assert [line for line in megatron_log if LINE in line] == []


def test_binding_leaves_megatrons_own_classes_and_refuses_a_wrong_collection():
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    from mcore_npu.transformer.mlp import NPUMLP

    assert mlp_process_group_keyword(MLP) is None
    assert mlp_process_group_keyword(MoELayer) is None
    assert mlp_process_group_keyword(NPUMLP) == "tp_group"
    assert mlp_process_group_keyword(torch.nn.Linear) is None
    plain = ModuleSpec(MLP)
    assert bind_mlp_process_groups(plain) is plain
    with pytest.raises(TypeError, match="pg_collection: .*got dict"):
        bind_mlp_process_groups(ModuleSpec(NPUMLP), pg_collection={"tp": None})
    groups = _own_process_groups()
    bound = bind_mlp_process_groups(ModuleSpec(NPUMLP, {"kernel": "reference"}), groups)
    copied = copy.deepcopy(bound)  # the process group is shared, the rest copied
    assert copied.params["tp_group"] is groups.tp and copied.params["kernel"] == "reference"


def test_multi_token_prediction_layers_from_either_spec_are_quiet_too(megatron_log):
    """Megatron's MTP block spec from the NPU decoder-block spec (its last layer) and from the
    NPU single-layer spec (``get_gpt_mtp_block_spec`` takes one only when its module is
    exactly ``TransformerLayer``)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec

    config = tiny_config(mtp_num_layers=1)
    block = get_gpt_decoder_block_npu_spec(config, kernel="reference", param_layout="te",
                                           normalization=config.normalization)  # fmt: skip
    for spec in (block, npu_spec(config, param_layout="te")):
        mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
        model = GPTModel(config, transformer_layer_spec=spec, vocab_size=VOCAB,
                         max_sequence_length=64, position_embedding_type="rope",
                         mtp_block_spec=mtp)  # fmt: skip
        mtp_layer = model.mtp.layers[0]  # its layer: 0.19+ names it mtp_model_layer
        layer = getattr(mtp_layer, "transformer_layer", None) or mtp_layer.mtp_model_layer
        assert type(layer) is TransformerLayer and type(layer.mlp).__name__ == "NPUMLP"
    assert [line for line in megatron_log if LINE in line] == []
