"""The CPU dry run's parts in one process (no Ray): the sampler of the ``hf_cpu`` rollout, its
weight loading, its registration in verl's two registries, and the verl platform.

Real parts: verl 0.9.1's registries and ``RolloutConfig``, transformers' Qwen3 on the tiny
checkpoint with the ChatML tokenizer (``tests/integrations/main_ppo_run.py``).
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("verl")

import torch

from tests.integrations import main_ppo_run


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return main_ppo_run.save_model(tmp_path_factory.mktemp("hf_cpu_model"))


@pytest.fixture(scope="module")
def model(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


PROMPT = [1, 5, 3, 20, 31, 44, 2, 3, 1, 6, 3]  # <|im_start|> user \n w20 w31 w44 <|im_end|> ...


def _full_log_probs(model, prompt, tokens, temperature=1.0) -> torch.Tensor:
    """``[R]``: each response token's log-prob from one forward over prompt + response."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    return log_probs.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_greedy_matches_transformers_generate(model):
    from mcore_npu.integrations.verl.cpu import sampler

    settings = sampler.Sampling(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens, log_probs, stop = sampler.sample(model, PROMPT, settings, {2}, torch.Generator())
    expected = model.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(PROMPT):]  # fmt: skip
    assert tokens == expected.tolist()
    assert stop == "completed"
    torch.testing.assert_close(torch.tensor(log_probs), _full_log_probs(model, PROMPT, tokens),
                               atol=1e-5, rtol=0)  # fmt: skip


def test_sampled_log_probs_are_at_the_temperature(model):
    """The KV-cached sampler's log-probs equal a full forward's ``log_softmax(logits / T)``."""
    from mcore_npu.integrations.verl.cpu import sampler

    settings = sampler.Sampling(temperature=0.7, max_tokens=8, ignore_eos=True)
    generator = torch.Generator().manual_seed(3)
    tokens, log_probs, _ = sampler.sample(model, PROMPT, settings, {2}, generator)
    assert len(tokens) == 8
    reference = _full_log_probs(model, PROMPT, tokens, temperature=0.7)
    torch.testing.assert_close(torch.tensor(log_probs), reference, atol=1e-5, rtol=0)


def test_top_k_one_and_tiny_top_p_are_greedy(model):
    from mcore_npu.integrations.verl.cpu import sampler

    greedy = sampler.Sampling(temperature=0.0, max_tokens=5, ignore_eos=True)
    expected, _, _ = sampler.sample(model, PROMPT, greedy, set(), torch.Generator())
    for settings in (sampler.Sampling(temperature=1.5, top_k=1, max_tokens=5, ignore_eos=True),
                     sampler.Sampling(temperature=1.5, top_p=1e-6, max_tokens=5,
                                      ignore_eos=True)):  # fmt: skip
        tokens, _, _ = sampler.sample(model, PROMPT, settings, set(), torch.Generator())
        assert tokens == expected


def test_filters_keep_only_the_candidates():
    from mcore_npu.integrations.verl.cpu import sampler

    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    assert torch.isfinite(sampler.filter_logits(logits, 2, 1.0)).tolist() == [False, True, False,
                                                                               True]  # fmt: skip
    # softmax: [0.032, 0.644, 0.087, 0.237]: top_p 0.7 keeps the two largest
    assert torch.isfinite(sampler.filter_logits(logits, -1, 0.7)).tolist() == [False, True, False,
                                                                                True]  # fmt: skip


def test_eos_stops_and_budget_from_request():
    from mcore_npu.integrations.verl.cpu import sampler

    assert sampler.Sampling.from_request({"temperature": 0}, max_tokens=5).max_tokens == 5
    assert sampler.Sampling.from_request({"max_tokens": 3}, max_tokens=5).max_tokens == 3
    assert sampler.Sampling.from_request({}, max_tokens=-4).max_tokens == 1  # at least one

    class AlwaysEos(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=True):
            logits = torch.zeros(1, input_ids.shape[1], 8)
            logits[..., 2] = 10.0
            return type("Out", (), {"logits": logits, "past_key_values": None})()

    tokens, _, stop = sampler.sample(AlwaysEos(), [1, 2], sampler.Sampling(temperature=0.0,
                                     max_tokens=6), {2}, torch.Generator())  # fmt: skip
    assert tokens == [2] and stop == "completed"


def test_load_exported_refuses_unknown_and_missing_names(model_dir):
    import transformers

    from mcore_npu.integrations.verl.cpu import rollout

    config = transformers.AutoConfig.from_pretrained(model_dir)
    target = rollout._random_model(config, seed=0)
    source = transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    with pytest.raises(ValueError, match="does not have"):
        rollout.load_exported(target, {**source, "model.extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="did not send"):
        rollout.load_exported(target, {k: v for k, v in source.items() if "layers.1." not in k})
    rollout.load_exported(target, {k: v.to(torch.bfloat16) for k, v in source.items()})
    for name, tensor in target.state_dict().items():
        assert torch.equal(tensor, source[name].to(torch.bfloat16).float()), name


def test_server_samples_only_synced_weights(model_dir):
    """Before the first sync the server refuses; after it, it samples the sent weights."""
    from verl.workers.config import HFModelConfig, RolloutConfig

    from mcore_npu.integrations.verl.cpu import rollout

    config = RolloutConfig(name=rollout.NAME, prompt_length=16, response_length=4)
    server = rollout.HfCpuServer(config, HFModelConfig(path=model_dir), replica_rank=0)
    params = {"temperature": 0, "logprobs": True}
    with pytest.raises(RuntimeError, match="before the first weight sync"):
        asyncio.run(server.generate("r0", PROMPT, dict(params)))
    import transformers

    weights = transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    asyncio.run(server.update_weights(weights, global_steps=1))
    output = asyncio.run(server.generate("r1", PROMPT, dict(params)))
    assert output.extra_fields["global_steps"] == 1 and 1 <= len(output.token_ids) <= 4
    assert len(output.log_probs) == len(output.token_ids)


def test_registered_in_both_registries():
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from mcore_npu.integrations.verl.cpu import rollout

    before = dict(base._ROLLOUT_REGISTRY), dict(RolloutReplicaRegistry._registry)
    try:
        rollout.register()
        assert base.get_rollout_class(rollout.NAME) is rollout.HfCpuRollout
        assert RolloutReplicaRegistry.get(rollout.NAME) is rollout.HfCpuReplica
    finally:
        base._ROLLOUT_REGISTRY.clear()
        base._ROLLOUT_REGISTRY.update(before[0])
        RolloutReplicaRegistry._registry.clear()
        RolloutReplicaRegistry._registry.update(before[1])


def test_platform_answers_for_a_cpu():
    from mcore_npu.integrations.verl.cpu.platform import CpuPlatform

    platform = CpuPlatform()
    assert (platform.device_name, platform.vendor_name) == ("cuda", "huawei")
    assert platform.communication_backend_name() == "gloo"
    assert platform.ray_resource_options(2) == {"resources": {"NPU": 2}}
    assert not platform.is_ipc_supported() and not platform.is_available()
    assert platform.is_platform_available(use_smi_check=True)  # this machine has no accelerator


def test_the_server_returns_each_tokens_experts_as_vllm(tmp_path):
    """``enable_rollout_routing_replay=True`` on a tiny Qwen3-MoE: ``routed_experts`` is
    ``[P + R - 1, L, k]`` (every token fed through the model: the prompt, then each sampled token
    but the last), and equals the routes of one forward over those tokens."""
    from verl.workers.config import HFModelConfig, RolloutConfig

    from mcore_npu.integrations.verl.cpu import rollout, routes
    from tests.integrations import verl_loop

    path = verl_loop.save_checkpoint("qwen3_moe", tmp_path / "moe")
    config = RolloutConfig(name=rollout.NAME, prompt_length=16, response_length=6,
                           enable_rollout_routing_replay=True)  # fmt: skip
    server = rollout.HfCpuServer(config, HFModelConfig(path=path), replica_rank=0)
    asyncio.run(server.update_weights(dict(server.model.state_dict()), global_steps=1))
    prompt = [5, 9, 11, 4, 7]
    params = {"temperature": 1.0, "ignore_eos": True}
    output = asyncio.run(server.generate("r0", prompt, params))
    got = output.routed_experts
    layers, top_k = len(routes.routers(server.model)), server.model.config.num_experts_per_tok
    assert got.shape == (len(prompt) + len(output.token_ids) - 1, layers, top_k)
    assert got.dtype == torch.int16
    with routes.recording(server.model) as recorded, torch.no_grad():
        server.model(input_ids=torch.tensor([prompt + output.token_ids[:-1]]))
    assert torch.equal(got, recorded.stacked())
    dense = rollout.HfCpuServer(RolloutConfig(name=rollout.NAME, prompt_length=16,
                                              response_length=2,
                                              enable_rollout_routing_replay=True),
                                HFModelConfig(path=verl_loop.save_checkpoint(
                                    "qwen3", tmp_path / "dense")), replica_rank=0)  # fmt: skip
    dense.synced = True
    with pytest.raises(ValueError, match="enable_rollout_routing_replay: .* no MoE router"):
        asyncio.run(dense.generate("r1", prompt, params))


def test_per_expert_exports_load_into_transformers_fused_experts(tmp_path):
    """The actor exports each expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` (the names
    vLLM loads); the server's transformers 5 Qwen3-MoE keeps them fused (``gate_up_proj``
    ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``): a model's weights, split per expert and loaded
    into another, give back every tensor exactly."""
    import transformers

    from mcore_npu.integrations.verl.cpu import rollout
    from tests.integrations import verl_loop

    config = verl_loop.hf_config("qwen3_moe")
    torch.manual_seed(1)
    source = transformers.AutoModelForCausalLM.from_config(config)
    per_expert = {}
    for name, tensor in source.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                per_expert[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate[e]
                per_expert[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up[e]
        elif name.endswith("experts.down_proj"):
            for e in range(tensor.shape[0]):
                per_expert[name.replace("down_proj", f"{e}.down_proj.weight")] = tensor[e]
        else:
            per_expert[name] = tensor
    torch.manual_seed(2)
    target = transformers.AutoModelForCausalLM.from_config(config)
    rollout.load_exported(target, per_expert)
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name
