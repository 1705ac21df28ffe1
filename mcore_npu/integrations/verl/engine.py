"""verl's Megatron engines on the NPU spec, without MindSpeed.

:class:`NPUMegatronEngineWithLMHead` / :class:`NPUMegatronEngineWithValueHead` subclass verl's
Megatron engines and change only: the recipe keys (:mod:`.recipe`, before verl reads them); the
layer spec (the NPU spec in TE names, set on this engine's bridge or provider, never on the bridge
modules); the bridge where mbridge has none or cannot build the config (:mod:`.tf_config`) or
Megatron-Bridge does not import (:mod:`.weight_path`); the micro-batch forward (:mod:`.forward`,
no dense mask); the optimizer and an exact Adam resume without TE or Apex (:mod:`.optimizer`);
the offload of a model without DDP on a host-only machine (:mod:`.offload`).

Registered for ``backend="megatron", device="npu", vendor="huawei"``, a key verl looks up before
the device-only key of its MindSpeed engine. See docs/verl.md.
"""

from __future__ import annotations

import functools
import logging
import sys

import torch
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.megatron import MegatronEngineWithLMHead, MegatronEngineWithValueHead
from verl.workers.engine.megatron.transformer_impl import register_megatron_training_hooks

from mcore_npu.integrations.hf import (
    PLUGIN_BRIDGES,
    bridge_from_config,
    builds_npu_mtp,
    checkpoint_spec_keywords,
    expose_hf_config_fields,
    install_npu_mtp_block,
    match_hf_routing,
    mbridge_expert_form,
    refuse_mbridge_mtp,
)
from mcore_npu.integrations.mbridge_fixes import needs_fixed_bridge
from mcore_npu.integrations.verl import weight_path
from mcore_npu.integrations.verl.batch_invariant import BatchInvariantLMHead
from mcore_npu.integrations.verl.forward import LMHeadSteps, ValueHeadSteps
from mcore_npu.integrations.verl.optimizer import (
    build_optimizer,
    grad_reduce_in_fp32,
    requested_keys,
)
from mcore_npu.integrations.verl.recipe import apply_recipe
from mcore_npu.integrations.verl.replay import refuse_replay_settings
from mcore_npu.integrations.verl.tf_config import build_mbridge_tf_config
from mcore_npu.integrations.verl.weight_path import megatron_bridge_unavailable
from mcore_npu.optimizer import AdamSettings
from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec

logger = logging.getLogger(__name__)

__all__ = [
    "NPUMegatronEngineWithLMHead",
    "NPUMegatronEngineWithValueHead",
    "npu_block_spec",
    "megatron_bridge_unavailable",
]

DEVICE = "npu"
VENDOR = "huawei"


def npu_block_spec(config, vp_stage: int | None = None, *, kernel: str = "auto", **spec_keywords):
    """The NPU decoder-block spec for ``config``, in TE parameter names; ``spec_keywords``: the
    recipe's fused-operator kernels (``rms_norm_kernel``, ...; ``recipe.apply_recipe``)."""
    return get_gpt_decoder_block_npu_spec(
        config, kernel=kernel, param_layout="te", vp_stage=vp_stage, **spec_keywords
    )


def _mbridge_layer_spec(bridge, vp_stage: int | None = None, *, spec: dict | None = None):
    """mbridge's ``_get_transformer_layer_spec(vp_stage)``, answered with the NPU spec."""
    return npu_block_spec(bridge.config, vp_stage, **(spec or {}))


def _provider_layer_spec(provider, vp_stage: int | None = None, *, spec: dict | None = None):
    """Megatron-Bridge's ``transformer_layer_spec(provider, vp_stage=...)`` callable form."""
    return npu_block_spec(provider, vp_stage, **(spec or {}))


class _NPUEngineMixin:
    """What both NPU engines change in verl's ``MegatronEngine`` (see the module docstring)."""

    npu_spec_keywords: dict = {}  # replaced per engine by _apply_recipe, never mutated
    mbridge_fallback: bool = False  # set per engine by _build_tf_config (weight_path.py)

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        weight_path.refuse_without_bridge(engine_config)  # before verl's raw assert on it
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)
        logger.info(
            "mcore_npu engine %s on rank %d (%s)",
            type(self).__name__,
            torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
            "forward only" if engine_config.forward_only else "training",
        )

    def _init_device_mesh(self):
        """verl's parallel state; on a CPU run, Megatron's RNG tracker seeded too (verl seeds it
        only on a device; without it the embedding's ``fork()`` fails in a fresh Ray worker)."""
        super()._init_device_mesh()
        from mcore_npu import cpu as cpu_runtime

        cpu_runtime.seed_if_applied(self.engine_config.seed)

    def _build_tf_config(self):
        hf_config = self.model_config.hf_config
        self.mbridge_fallback = weight_path.mbridge_fallback(self.engine_config, hf_config)
        self._apply_recipe()
        self._check_optimizer_config()
        if self.engine_config.vanilla_mbridge and _plugin_builds_bridge(hf_config):
            # mbridge cannot build this config (DeepSeek-V3) or has no bridge (Qwen3.5): the
            # plugin builds the bridge, in verl's steps; mbridge and verl stay unpatched
            build_mbridge_tf_config(self, bridge_from_config)
        else:
            super()._build_tf_config()
        self._install_npu_layer_spec()
        if self.provider is None:
            self._match_hf_config()

    def _check_optimizer_config(self) -> None:
        """Refuse, before any model is built, precision / offload keys the plugin's optimizer
        cannot build (:class:`~mcore_npu.optimizer.AdamSettings`)."""
        if self.engine_config.forward_only or self.optimizer_config is None:
            return
        from verl.utils.torch_dtypes import PrecisionType

        bf16 = PrecisionType.to_dtype(self.engine_config.dtype) == torch.bfloat16
        recipe_keys = self.recipe_plan.optimizer_keys
        keys = requested_keys(self.optimizer_config, bf16=bf16, recipe_keys=recipe_keys)
        AdamSettings.from_keys(keys).check_against(
            optimizer=self.optimizer_config.optimizer,
            use_distributed_optimizer=self.engine_config.use_distributed_optimizer,
        )

    def _build_optimizer(self):
        """verl's optimizer build through :func:`.optimizer.build_optimizer` (the plugin's Adam
        where the precision-aware optimizer or the CPU offload asks)."""
        optimizer = build_optimizer(self, self.recipe_plan.optimizer_keys)
        register_megatron_training_hooks(self.module, optimizer)
        return optimizer

    def _resolve_override_ddp_config(self) -> dict:
        """verl's DDP overrides, ``grad_reduce_in_fp32`` following ``main_grads_dtype`` wherever
        it is set (verl reads only the top-level key); an explicit override wins."""
        resolved = super()._resolve_override_ddp_config()
        given = dict(self.engine_config.override_ddp_config or {})
        if self.optimizer_config is not None and "grad_reduce_in_fp32" not in given:
            resolved["grad_reduce_in_fp32"] = grad_reduce_in_fp32(
                self.optimizer_config,
                bf16=self.param_dtype == torch.bfloat16,
                recipe_keys=self.recipe_plan.optimizer_keys,
            )
        return resolved

    def _apply_recipe(self) -> None:
        """The recipe vocabulary (:func:`.recipe.apply_recipe`) before verl reads the overrides:
        ``engine_config`` becomes this engine's own copy, the spec keywords go to
        :attr:`npu_spec_keywords`; a refused key raises ``ValueError`` here."""
        hf_config, config = self.model_config.hf_config, self.engine_config
        refuse_replay_settings(config, mtp=self.model_config.mtp.enable)
        megatron_bridge = not (config.vanilla_mbridge or self.mbridge_fallback)
        provider = weight_path.megatron_bridge_overrides(hf_config) if megatron_bridge else None
        self.engine_config, self.npu_spec_keywords, self.recipe_plan = apply_recipe(
            config, hf_config, mbridge_fallback=self.mbridge_fallback, provider=provider
        )

    def _match_hf_config(self) -> None:
        """The Hugging Face config fixes of :func:`mcore_npu.integrations.hf.use_npu_spec` on
        this engine's mbridge bridge, before the model is built or any weight loaded.

        ``set_extra_args`` (the router form) builds a new config object, so the field is copied
        onto verl's ``self.tf_config`` (which holds verl's own edits) and the bridge pointed back
        at it: the two stay one object, as verl built them.
        """
        bridge, tf_config = self.bridge, self.tf_config
        refuse_mbridge_mtp(tf_config, bridge)  # mbridge would build TE's MTP layers
        expose_hf_config_fields(bridge.hf_config)
        match_hf_routing(bridge)
        tf_config.moe_router_pre_softmax = bridge.config.moe_router_pre_softmax
        bridge.config = tf_config

    def _install_npu_layer_spec(self) -> None:
        """Point this engine's bridge (or provider) at the NPU spec; the bridge class is untouched."""
        spec = {**checkpoint_spec_keywords(self.model_config.hf_config), **self.npu_spec_keywords}
        if self.provider is not None:  # Megatron-Bridge
            weight_path.register_npu_modules()  # its AutoMapping finds splits by class name
            self.provider.transformer_layer_spec = functools.partial(
                _provider_layer_spec, spec=spec
            )
        elif getattr(self.bridge, "own_npu_spec", False):  # Nemotron-H, Qwen3-VL: their own
            self.bridge.npu_spec_keywords = spec
        elif self.bridge is not None:  # mbridge (vanilla_mbridge=True)
            spec.update(mbridge_expert_form(self.bridge.config))
            layer_spec = functools.partial(_mbridge_layer_spec, self.bridge, spec=spec)
            self.bridge._get_transformer_layer_spec = layer_spec
            if builds_npu_mtp(self.bridge):  # MiMo: its MTP layers from the NPU spec too
                install_npu_mtp_block(self.bridge, layer_spec, **spec)
        else:
            raise ValueError(
                "engine_config.use_mbridge: the NPU Megatron engine builds its model through a "
                "bridge (mbridge or Megatron-Bridge); got no bridge. Set use_mbridge=True."
            )

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        """verl's ``load_checkpoint`` inside
        :func:`~mcore_npu.training.optimizer_resume.exact_adam_resume`: the Adam state restored
        exactly where Megatron's optimizer runs over torch's Adam (no TE or Apex)."""
        from mcore_npu.training.optimizer_resume import exact_adam_resume

        with exact_adam_resume(self.optimizer):
            return super().load_checkpoint(
                local_path, hdfs_path, del_local_after_load=del_local_after_load, **kwargs
            )

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        """verl's ``to``; a model without DDP on a host-only machine, whose weights verl's
        offload would free, moves as real host copies (:mod:`.offload`)."""
        from mcore_npu.integrations.verl.offload import host_only_model, round_trip_on_host

        if model and host_only_model(self.module):
            round_trip_on_host(self.module)
            model = grad = False
        return super().to(device, model=model, optimizer=optimizer, grad=grad)


def _plugin_builds_bridge(hf_config) -> bool:
    """Whether the plugin builds this model's bridge (``hf.bridge_from_config``), not mbridge."""
    return needs_fixed_bridge(hf_config) or getattr(hf_config, "model_type", None) in PLUGIN_BRIDGES


class NPUMegatronEngineWithLMHead(
    _NPUEngineMixin, BatchInvariantLMHead, LMHeadSteps, MegatronEngineWithLMHead
):
    """verl's Megatron LM-head engine with NPU layers and mask-free micro-batches."""


class NPUMegatronEngineWithValueHead(_NPUEngineMixin, ValueHeadSteps, MegatronEngineWithValueHead):
    """verl's Megatron value-head engine with NPU layers and mask-free micro-batches."""


def register() -> tuple[type, type]:
    """Register both engines for ``backend="megatron", device="npu", vendor="huawei"``;
    idempotent (verl's registry asserts on a second registration of a key)."""
    engines = EngineRegistry._engines
    for model_type, engine in (
        ("language_model", NPUMegatronEngineWithLMHead),
        ("value_model", NPUMegatronEngineWithValueHead),
    ):
        current = engines.get(model_type, {}).get("megatron", {}).get((DEVICE, VENDOR))
        if current is engine:
            continue
        EngineRegistry.register(model_type, backend="megatron", device=DEVICE, vendor=VENDOR)(
            engine
        )
    return NPUMegatronEngineWithLMHead, NPUMegatronEngineWithValueHead


def _register_deferred() -> None:
    """The plugin could not register this module half built (see ``plugin.deferred``)."""
    plugin = sys.modules.get("mcore_npu.integrations.verl.plugin")
    if plugin is not None and plugin.deferred:
        register()


_register_deferred()
