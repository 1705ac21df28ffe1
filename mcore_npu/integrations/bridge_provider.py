"""The model provider of the plugin's own mbridge bridges (Nemotron-H, Qwen3-VL), as mbridge's
``get_model`` calls it."""

from __future__ import annotations


def model_provider(bridge, build, callbacks):
    """mbridge's ``provider(pre_process, post_process, vp_stage=None)``: ``build(pre_process,
    post_process, vp_stage)``, then each of mbridge's post-creation ``callbacks`` on the model with
    the bridge's configs."""

    def provider(pre_process, post_process, vp_stage=None):
        model = build(pre_process, post_process, vp_stage)
        for callback in callbacks:
            callback(model, pre_process=pre_process, post_process=post_process,
                     config=bridge.config, hf_config=bridge.hf_config)  # fmt: skip
        return model

    return provider
