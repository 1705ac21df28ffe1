"""An NPU Megatron engine for verl, without MindSpeed.

verl 0.9.x runs Megatron on NPU through ``MindspeedEngineWithLMHead``
(``verl/workers/engine/mindspeed/transformer_impl.py``): MindSpeed's ``repatch`` rewires the TE
layer spec underneath, the bshd path builds a dense ``[B, 1, S, S]`` mask per micro-batch
(``verl.models.mcore.util._build_npu_attn_mask``) and the thd path hands sequence lengths to
MindSpeed through process globals. The engines here subclass verl's own Megatron engines and
change these things, nothing else:

0. **Recipe keys.** ``override_transformer_config`` goes through the recipe vocabulary
   (``specs/recipe_keys.yaml``, :mod:`mcore_npu.integrations.verl.recipe`) before verl reads it:
   verl gets only Megatron fields, the fused-operator switches become NPU spec keywords, the
   recipe's ``use_distributed_optimizer`` lands in this engine's copy of the engine config, and a
   refused key stops the build with one line before any model exists.
1. **Model.** Every layer comes from :func:`mcore_npu.get_gpt_decoder_block_npu_spec` (core
   attention ``NPUFusionAttention``), in Transformer Engine parameter names
   (``param_layout="te"``), so the bridges' HF <-> TE name maps load and export weights
   unchanged. The spec goes in through the
   bridge's own hook, on this engine's bridge object only: mbridge's
   ``_get_transformer_layer_spec`` (an instance attribute) or Megatron-Bridge's
   ``provider.transformer_layer_spec``. The bridge modules are not patched. With mbridge the
   engine also applies ``use_npu_spec``'s config fixes (``rope_theta``, ``head_dim``, the
   router's softmax form of the Hugging Face model: ``match_hf_routing``) to the bridge and to
   ``self.tf_config``; an explicit ``override_transformer_config`` value wins. A model whose
   mbridge bridge cannot build its config on this stack (DeepSeek-V3, see
   :mod:`mcore_npu.integrations.mbridge_fixes`), or that mbridge has no bridge for (the Gated
   DeltaNet hybrids Qwen3.5 / Qwen3-Next, ``mcore_npu.integrations.hf_qwen3_5``), gets the
   plugin's bridge, built before any config, in verl's steps
   (:mod:`mcore_npu.integrations.verl.tf_config`). Multi-token
   prediction (verl's ``model.mtp.*``): for mbridge's MiMo bridge the MTP layers come from the
   NPU spec too (``hf.install_npu_mtp_block``, on this engine's bridge); with any other bridge
   it is refused before any model exists (mbridge builds it from TE's spec).
   Megatron-Bridge (``vanilla_mbridge=False``, verl 0.9.1's default) is used when
   ``import megatron.bridge`` succeeds (its provider gets ``moe_permute_fusion=False``, the
   Hugging Face router form and ``attention_backend=auto``, and its ``AutoMapping`` learns the
   plugin's router and expert classes); when it fails, a model family the plugin's Hugging Face
   path covers builds through mbridge exactly as with ``vanilla_mbridge=True`` (one warning
   line; this engine's copy of the engine config carries the value), any other is refused
   (:mod:`mcore_npu.integrations.verl.weight_path`, docs/weight_path.md). ``use_mbridge=False``,
   on which verl 0.9.1's engine asserts, is refused in one line before verl's ``__init__`` runs.
2. **The forward of a micro-batch** (:mod:`mcore_npu.integrations.verl.forward`): bshd runs
   without a mask tensor (the cached compressed causal mask), and so does thd of a
   vision-language checkpoint whose language model the plugin builds; every mask verl's own
   forwards hand the model is accepted (the ``[B, S]`` keep mask as right padding).
3. **Sequential experts** (``moe_grouped_gemm=False``): mbridge maps only the grouped experts'
   names, so through mbridge the grouped experts are built instead, with one log line
   (``hf.mbridge_expert_form``); the computation is the same.
4. **The optimizer without TE or Apex** (as on an NPU without MindSpeed): Megatron's
   distributed optimizer runs over torch's Adam, and a load into a fresh worker asserts on its
   empty state and then restores the step counter as 0, one tensor shared by all parameters.
   ``load_checkpoint`` loads through
   :func:`mcore_npu.training.optimizer_resume.exact_adam_resume`, so a resumed run continues
   exactly (TE/Apex optimizers are left alone). ``use_precision_aware_optimizer=True`` and
   ``optimizer_cpu_offload=True``, which megatron-core cannot build without TE or CUDA, are built
   by :meth:`_NPUEngineMixin._build_optimizer` (:mod:`mcore_npu.integrations.verl.optimizer`):
   Megatron's own distributed optimizer over the plugin's
   :class:`~mcore_npu.optimizer.PrecisionAwareAdam`; their values are checked before any model
   is built. ``swap_optimizer`` (MindSpeed) maps to the CPU offload.
5. **Offload of a model without DDP on a host-only machine** (the reference model's
   ``param_offload`` on a CPU): verl's move would free the only copy of the weights there; the
   engine's ``to`` moves it as real host copies (:mod:`mcore_npu.integrations.verl.offload`).
   With an accelerator verl's own offload runs.

Registered for ``backend="megatron", device="npu", vendor="huawei"`` as the language-model and
value-model engines. verl picks a ``(device, vendor)`` key before the device-only key of its
MindSpeed engine, so on Ascend (or with ``VERL_ENGINE_DEVICE=npu VERL_ENGINE_VENDOR=huawei``)
``EngineRegistry.get_engine_cls`` returns these classes once the entry point has loaded.
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
    expose_hf_config_fields,
    install_npu_mtp_block,
    match_hf_routing,
    mbridge_expert_form,
    refuse_mbridge_mtp,
)
from mcore_npu.integrations.mbridge_fixes import needs_fixed_bridge
from mcore_npu.integrations.verl import weight_path
from mcore_npu.integrations.verl.forward import LMHeadSteps, ValueHeadSteps
from mcore_npu.integrations.verl.optimizer import (
    build_optimizer,
    grad_reduce_in_fp32,
    requested_keys,
)
from mcore_npu.integrations.verl.recipe import apply_recipe
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
    """The NPU decoder-block spec for ``config``, in TE parameter names. ``spec_keywords``: the
    fused-operator kernels the recipe asked for (``rms_norm_kernel``, ``swiglu_kernel``, ...;
    see ``recipe.apply_recipe``)."""
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
    """What both NPU engines change in verl's ``MegatronEngine`` to build the model and the
    optimizer: the recipe keys, the spec hook, the optimizer, checkpoint loading, offload."""

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
        """verl's parallel state, then, where the project's CPU shims are applied (a CPU run),
        Megatron's RNG tracker seeded with ``engine_config.seed`` (verl seeds it only on a
        device; without it the embedding's ``fork()`` fails in a fresh Ray worker)."""
        super()._init_device_mesh()
        from mcore_npu import cpu as cpu_runtime

        cpu_runtime.seed_if_applied(self.engine_config.seed)

    def _build_tf_config(self):
        hf_config = self.model_config.hf_config
        self.mbridge_fallback = weight_path.mbridge_fallback(self.engine_config, hf_config)
        self._apply_recipe()
        self._check_optimizer_config()
        if self.engine_config.vanilla_mbridge and _plugin_builds_bridge(hf_config):
            # mbridge's own bridge cannot build this config (DeepSeek-V3), or mbridge has none
            # (Qwen3.5, Qwen3-Next): the plugin builds the bridge, in verl's steps
            # (tf_config.py); mbridge and verl stay unpatched
            build_mbridge_tf_config(self, bridge_from_config)
        else:
            super()._build_tf_config()
        self._install_npu_layer_spec()
        if self.provider is None:
            self._match_hf_config()

    def _check_optimizer_config(self) -> None:
        """Check the optimizer's precision and offload keys before any model is built.

        ``use_precision_aware_optimizer`` and ``optimizer_cpu_offload`` (the large Ascend recipes
        set both in ``override_optimizer_config``) are built by the plugin
        (:meth:`_build_optimizer`); a value that cannot work is refused here in one line
        (:class:`~mcore_npu.optimizer.AdamSettings`) instead of reaching megatron-core, whose
        ``OptimizerConfig`` raises a raw ``TypeError`` for the first without Transformer Engine.
        """
        if self.engine_config.forward_only or self.optimizer_config is None:
            return
        from verl.utils.torch_dtypes import PrecisionType

        bf16 = PrecisionType.to_dtype(self.engine_config.dtype) == torch.bfloat16
        keys = requested_keys(self.optimizer_config, bf16=bf16,
                              recipe_keys=self.recipe_plan.optimizer_keys)  # fmt: skip
        AdamSettings.from_keys(keys).check_against(
            optimizer=self.optimizer_config.optimizer,
            use_distributed_optimizer=self.engine_config.use_distributed_optimizer,
        )

    def _build_optimizer(self):
        """verl's optimizer build (``transformer_impl.py:539``) through
        :func:`~mcore_npu.integrations.verl.optimizer.build_optimizer`: Megatron's optimizer,
        with the plugin's Adam where the precision-aware optimizer or the CPU offload asks."""
        optimizer = build_optimizer(self, self.recipe_plan.optimizer_keys)
        register_megatron_training_hooks(self.module, optimizer)
        return optimizer

    def _resolve_override_ddp_config(self) -> dict:
        """verl's DDP overrides, with ``grad_reduce_in_fp32`` following ``main_grads_dtype``
        wherever verl's optimizer keys set it (``override_optimizer_config`` too; verl reads
        only the top-level key); an explicit ``override_ddp_config.grad_reduce_in_fp32`` wins."""
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
        """The recipe vocabulary (``specs/recipe_keys.yaml``), before verl reads the overrides.

        This engine's ``engine_config`` becomes a copy holding only Megatron fields in
        ``override_transformer_config``, the recipe's ``use_distributed_optimizer`` and, with
        :attr:`mbridge_fallback`, ``vanilla_mbridge=True`` (on the Megatron-Bridge path, the
        provider fields of ``weight_path.megatron_bridge_overrides``); the spec keywords go to
        :attr:`npu_spec_keywords`. The user's config object is not changed.
        Refused keys raise ``ValueError`` here, before any bridge or model is built.
        """
        hf_config, config = self.model_config.hf_config, self.engine_config
        megatron_bridge = not (config.vanilla_mbridge or self.mbridge_fallback)
        provider = weight_path.megatron_bridge_overrides(hf_config) if megatron_bridge else None
        self.engine_config, self.npu_spec_keywords, self.recipe_plan = apply_recipe(
            config, hf_config, mbridge_fallback=self.mbridge_fallback, provider=provider
        )

    def _match_hf_config(self) -> None:
        """The Hugging Face config fixes of :func:`mcore_npu.integrations.hf.use_npu_spec`, on
        this engine's mbridge bridge, so ``self.tf_config`` and ``bridge.config`` carry them.

        Runs after verl's ``_build_tf_config``, before the model is built and before any weight
        is loaded (mbridge merges q/k/v with ``hf_config.head_dim``). ``bridge.hf_config`` is
        verl's ``model_config.hf_config`` (the object verl itself gives ``rope_theta`` in
        ``make_megatron_module``); the values written are the ones transformers uses.

        The router form goes through ``match_hf_routing`` (``bridge.set_extra_args``, so a rebuilt
        ``bridge.config`` keeps it and Megatron validates it), which leaves a value the user set
        in ``override_transformer_config`` alone. ``set_extra_args`` builds a new config object;
        the field is copied onto verl's (``self.tf_config``, which holds verl's own edits: fp16 /
        bf16, the value head's untied embeddings, routing replay) and the bridge is pointed back
        at it, so the two stay one object, as verl built them.
        """
        bridge, tf_config = self.bridge, self.tf_config
        refuse_mbridge_mtp(tf_config, bridge)  # mbridge would build TE's MTP layers
        expose_hf_config_fields(bridge.hf_config)
        match_hf_routing(bridge)
        tf_config.moe_router_pre_softmax = bridge.config.moe_router_pre_softmax
        bridge.config = tf_config

    def _install_npu_layer_spec(self) -> None:
        """Point this engine's bridge (or provider) at the NPU spec; the bridge class is untouched."""
        spec = dict(self.npu_spec_keywords)
        if self.provider is not None:  # Megatron-Bridge
            weight_path.register_npu_modules()  # its AutoMapping finds splits by class name
            self.provider.transformer_layer_spec = functools.partial(
                _provider_layer_spec, spec=spec
            )
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
        """verl's ``load_checkpoint``, with the Adam state restored exactly.

        Without TE or Apex (an NPU without MindSpeed, or a CPU) Megatron's distributed optimizer
        runs over torch's Adam: loading into a fresh worker asserts on its empty state, and the
        restored step counter is the fresh optimizer's 0, shared by every parameter
        (:mod:`mcore_npu.training.optimizer_resume` names the lines). The load runs inside
        :func:`~mcore_npu.training.optimizer_resume.exact_adam_resume`, which changes nothing
        for TE/Apex optimizers.
        """
        from mcore_npu.training.optimizer_resume import exact_adam_resume

        with exact_adam_resume(self.optimizer):
            return super().load_checkpoint(
                local_path, hdfs_path, del_local_after_load=del_local_after_load, **kwargs
            )

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        """verl's ``to``, except for a model without DDP (the reference model) on a machine
        without an accelerator, whose weights verl's offload would free
        (:mod:`mcore_npu.integrations.verl.offload`): there the model moves as real host copies."""
        from mcore_npu.integrations.verl.offload import host_only_model, round_trip_on_host

        if model and host_only_model(self.module):
            round_trip_on_host(self.module)
            model = grad = False
        return super().to(device, model=model, optimizer=optimizer, grad=grad)


def _plugin_builds_bridge(hf_config) -> bool:
    """Whether the plugin builds this model's bridge (``hf.bridge_from_config``) rather than
    ``mbridge.AutoBridge``: the fixed DeepSeek-V3 bridge and the plugin's own GDN-hybrid bridges."""
    return needs_fixed_bridge(hf_config) or getattr(hf_config, "model_type", None) in PLUGIN_BRIDGES


class NPUMegatronEngineWithLMHead(_NPUEngineMixin, LMHeadSteps, MegatronEngineWithLMHead):
    """verl's Megatron LM-head engine with NPU layers and mask-free micro-batches."""


class NPUMegatronEngineWithValueHead(_NPUEngineMixin, ValueHeadSteps, MegatronEngineWithValueHead):
    """verl's Megatron value-head engine with NPU layers and mask-free micro-batches."""


def register() -> tuple[type, type]:
    """Register both engines for ``backend="megatron", device="npu", vendor="huawei"``.

    Idempotent: a key that already holds these classes is left alone (verl's registry asserts
    on a second registration of the same key).
    """
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
