"""LoRA on the workers: PEFT checkpoints served per request, checked against PEFT's own model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from engine_core.config import CacheConfig, LoRAConfig, SchedulerConfig
from engine_core.outputs import LoRARequest
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_core.sched.scheduler import Scheduler
from gpu_worker.lora.peft_adapter import load_peft_adapter
from gpu_worker.worker import Worker
from tests.gpu_worker.utils import hf_greedy, load_hf, prefill_logits, run_to_completion, save_tiny_model, two_tp_ranks
from tests.lora_adapters import peft_model, save_adapter

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A base model, two adapters (one rank-stabilised, on a subset of projections) and the
    greedy answers of PEFT's models and the base model to a few prompts."""
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_model(root / "base", num_key_value_heads=1, vocab_size=251, tie_word_embeddings=True)
    kwargs_a = dict(seed=1, r=8, alpha=16.0)
    kwargs_b = dict(seed=2, r=4, alpha=8.0, use_rslora=True, targets=("q_proj", "v_proj", "down_proj"))
    save_adapter(base, root / "a", **kwargs_a)
    save_adapter(base, root / "b", **kwargs_b)
    rng = random.Random(5)
    prompts = [[rng.randrange(251) for _ in range(rng.randrange(3, 20))] for _ in range(6)]
    models = {0: load_hf(base), 1: peft_model(base, **kwargs_a), 2: peft_model(base, **kwargs_b)}
    adapters = {1: LoRARequest("a", 1, str(root / "a")), 2: LoRARequest("b", 2, str(root / "b"))}
    # Request i runs under adapter i % 3: base, a, b, base, a, b.
    expected = {f"r{i}": hf_greedy(models[i % 3], p, MAX_TOKENS) for i, p in enumerate(prompts)}
    return base, adapters, prompts, expected


def _drive(execute, adapters: dict[int, LoRARequest], prompts: list[list[int]], max_loras: int,
           budget: int = 16, batches: list[set[int]] | None = None) -> dict[str, list[int]]:
    sched = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget, max_model_len=128),
                      CacheConfig(block_size=4, num_blocks=60), log_stats=False,
                      lora_config=LoRAConfig(max_loras=max_loras))
    for i, p in enumerate(prompts):
        sched.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                                  lora_request=adapters.get(i % 3)))

    def record(_: int, so) -> None:
        if batches is not None:
            ids = {sched.requests[r].lora_request.lora_int_id for r in so.num_scheduled_tokens
                   if sched.requests[r].lora_request is not None}
            batches.append(ids)

    return run_to_completion(sched, execute, on_step=record)


def _worker(base: Path, adapters: dict[int, LoRARequest], **kwargs) -> Worker:
    worker = Worker(0, 1, str(base), device="cpu", dtype="float32", max_model_len=128, max_lora_rank=8, **kwargs)
    worker.load_model()
    worker.initialize_cache(60, 4)
    for lora in adapters.values():
        assert worker.add_lora(lora)
    return worker


def _recording(runner, read, into: list):
    """The runner's execute_model, appending ``read()`` to ``into`` after each step."""
    def execute(so):
        out = runner.execute_model(so)
        into.append(read())
        return out
    return execute


def _runner(base: Path, adapters: dict[int, LoRARequest], **kwargs):
    """A CPU model runner with the adapters added (``kwargs``: its LoRA memory limits)."""
    from gpu_worker.config import ModelConfig
    from gpu_worker.model_runner import ModelRunner

    runner = ModelRunner(ModelConfig.from_pretrained(base), "cpu", max_model_len=128, max_lora_rank=8, **kwargs)
    runner.load_model(base)
    runner.initialize_kv_cache(60, 4)
    for lora in adapters.values():
        assert runner.lora.add_adapter(lora)
    return runner


@pytest.mark.parametrize(("max_loras", "budget"), [(2, 16), (1, 7), (2, 64)])
def test_mixed_batches_equal_each_adapters_peft_model(setup, max_loras, budget):
    """Base-model requests and two adapters' requests in the same batches (chunked prefills,
    decodes, rows of one adapter not contiguous) give exactly what PEFT's model gives each."""
    base, adapters, prompts, expected = setup
    worker = _worker(base, adapters)
    batches: list[set[int]] = []
    assert _drive(worker.execute_model, adapters, prompts, max_loras, budget, batches) == expected
    assert max(len(b) for b in batches) == max_loras  # the scheduler held the cap, and reached it
    assert worker.list_loras() == [1, 2]


def test_an_adapter_changes_the_answers_and_unloading_it_restores_nothing_else(setup):
    base, adapters, prompts, expected = setup
    # The adapters do change the model's answers (else the test above would prove nothing).
    assert expected["r1"] != hf_greedy(load_hf(base), prompts[1], MAX_TOKENS)
    worker = _worker(base, adapters)
    assert worker.add_lora(adapters[1]) is False  # already held
    with pytest.raises(ValueError, match="already"):
        worker.add_lora(LoRARequest("other", 1, adapters[2].lora_path))
    assert worker.remove_lora(1) and not worker.remove_lora(1)
    assert worker.list_loras() == [2]


@pytest.mark.slow
def test_tp2_over_gloo_serves_adapters_as_tp1(setup, tp_hosts):
    """Column-parallel shards of B and row-parallel shards of A, summed by the all-reduce, give
    the same answers as one rank (one KV head replicated on both ranks, a padded vocabulary)."""
    import ray

    base, adapters, prompts, expected = setup
    with two_tp_ranks(base, tp_hosts, device="cpu", dtype="float32", max_model_len=128, num_cpus=1,
                      max_lora_rank=8) as (ranks, execute):
        ray.get([w.initialize_cache.remote(60, 4) for w in ranks])
        for lora in adapters.values():
            assert ray.get([w.add_lora.remote(lora) for w in ranks]) == [True, True]
        assert _drive(execute, adapters, prompts, max_loras=2) == expected


def test_adapter_weights_and_scaling(setup):
    _, adapters, _, _ = setup
    a = load_peft_adapter(adapters[1].lora_path, max_lora_rank=8)
    b = load_peft_adapter(adapters[2].lora_path, max_lora_rank=8)
    assert (a.rank, a.scaling) == (8, 2.0)
    assert (b.rank, b.scaling) == (4, 8.0 / 2.0)  # rsLoRA: alpha / sqrt(r)
    assert sorted({m.rsplit(".", 1)[1] for m in b.weights}) == ["down_proj", "q_proj", "v_proj"]
    lora_a, lora_b = a.weights["model.layers.1.self_attn.k_proj"]
    assert lora_a.shape == (8, 64) and lora_b.shape == (16, 8)  # one KV head of 16 dims


def _edited_copy(src: str, dst: Path, **config_changes) -> Path:
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(config_changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(("changes", "message"), [
    ({"use_dora": True}, "DoRA"),
    ({"lora_bias": True}, "bias on lora_B"),
    ({"bias": "all"}, "trained biases"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": "four"}}, "rank_pattern must map module patterns to positive numbers"),
    ({"alpha_pattern": {"q_proj(": 4}}, "alpha_pattern key 'q_proj\\(' is not a regular expression"),
    ({"peft_type": "IA3"}, "not LORA"),
    ({"r": 32}, "above --max-lora-rank 8"),
    ({"init_lora_weights": "pissa"}, "change the base model's weights"),
    ({"init_lora_weights": "olora"}, "change the base model's weights"),
    ({"arrow_config": {"top_k": 2}}, "Arrow"),
])
def test_adapters_the_model_cannot_serve_are_refused_by_name(setup, tmp_path, changes, message):
    base, adapters, _, _ = setup
    bad = _edited_copy(adapters[1].lora_path, tmp_path / "bad", **changes)
    worker = _worker(base, {})
    with pytest.raises(ValueError, match=message):
        worker.add_lora(LoRARequest("bad", 3, str(bad)))
    assert worker.list_loras() == []


def test_an_adapter_for_another_model_or_not_an_adapter_is_refused(setup, tmp_path):
    base, _, _, _ = setup
    worker = _worker(base, {})
    other = save_tiny_model(tmp_path / "wide", hidden_size=96, vocab_size=251)
    with pytest.raises(ValueError, match="do not fit the model"):
        worker.add_lora(LoRARequest("wide", 3, str(save_adapter(other, tmp_path / "wide_adapter"))))
    # Same hidden size, more KV heads and a wider MLP: the loaders alone would take a slice of B.
    taller = save_tiny_model(tmp_path / "taller", num_key_value_heads=2, intermediate_size=256, vocab_size=251)
    with pytest.raises(ValueError, match="lora_A has 256 inputs, the layer 128"):  # down_proj
        worker.add_lora(LoRARequest("taller", 6, str(save_adapter(taller, tmp_path / "taller_adapter"))))
    with pytest.raises(ValueError, match="lora_B of 0 has 256 outputs, the layer 128"):  # gate_proj
        worker.add_lora(LoRARequest("gate", 8, str(save_adapter(taller, tmp_path / "gate_adapter",
                                                                targets=("gate_proj",)))))
    only_k = save_tiny_model(tmp_path / "only_k", num_key_value_heads=2, vocab_size=251)
    with pytest.raises(ValueError, match="lora_B of k has 32 outputs, the layer 16"):
        worker.add_lora(LoRARequest("k", 7, str(save_adapter(only_k, tmp_path / "k_adapter", targets=("k_proj",)))))
    with pytest.raises(ValueError, match=r"no adapter_config\.json"):
        worker.add_lora(LoRARequest("nothing", 4, str(tmp_path)))
    head = save_adapter(base, tmp_path / "head", targets=("q_proj", "lm_head"))
    with pytest.raises(ValueError, match="lm_head"):
        worker.add_lora(LoRARequest("head", 5, str(head)))
    assert worker.list_loras() == []


def test_each_adapters_rows_get_its_own_delta_however_they_are_laid_out(setup):
    """set_batch's runs of rows: an adapter's requests scattered through the batch (the runner
    sorts them side by side, but the layer must not depend on it)."""
    import numpy as np
    import torch

    base, adapters, _, _ = setup
    worker = _worker(base, adapters)
    manager = worker.runner.lora
    qsl = np.array([0, 3, 4, 9, 10, 12, 13])  # 6 requests of 3, 1, 5, 1, 2 and 1 tokens
    ids = [1, 0, 1, 2, 1, 2]
    manager.set_batch(ids, qsl)
    groups = {adapter.lora_int_id: rows for adapter, rows in manager.batch.groups}
    assert groups == {1: [slice(0, 3), slice(4, 9), slice(10, 12)], 2: [slice(9, 10), slice(12, 13)]}
    layer = manager.layers["model.layers.0.mlp.down_proj"]
    x = torch.randn(13, layer.base.input_size_per_partition)
    out = layer.forward(x)
    plain = torch.nn.functional.linear(x, layer.base.weight, layer.base.bias)
    token_ids = np.repeat(ids, np.diff(qsl))
    for row, lora_id in enumerate(token_ids):
        expected = plain[row]
        if lora_id:
            a_t, b_t = manager.adapters[lora_id].layers["model.layers.0.mlp.down_proj"]
            expected = expected + (x[row] @ a_t) @ b_t
        torch.testing.assert_close(out[row], expected)
    manager.set_batch([0, 0], np.array([0, 1, 2]))
    assert manager.batch.groups == []


def test_with_a_device_limit_adapters_wait_in_host_memory_and_cycle_through_the_device(setup):
    """As on an accelerator (here simulated on the CPU): at most max_loras adapters on the device;
    each step's are copied in, replacing the least recently used; answers stay PEFT's."""
    import numpy as np

    base, adapters, prompts, expected = setup
    runner = _runner(base, adapters, max_resident_loras=1)
    assert runner.lora.resident_adapters() == []  # loaded, in host memory only
    resident: list[list[int]] = []
    assert _drive(_recording(runner, runner.lora.resident_adapters, resident), adapters, prompts,
                  max_loras=1) == expected
    assert max(len(r) for r in resident) == 1 and {tuple(r) for r in resident} >= {(1,), (2,)}
    assert runner.lora.num_copies_in >= 2
    with pytest.raises(RuntimeError, match="more than max_loras=1"):
        runner.lora.set_batch([1, 2], np.array([0, 1, 2]))


@pytest.mark.parametrize("max_resident", [None, 1], ids=["cpu", "device-slots"])
def test_with_a_host_memory_limit_adapters_are_read_again_when_needed(setup, max_resident):
    """--max-cpu-loras 1 with two adapters alternating: one stays in memory, the other is read from
    its checkpoint again when a step needs it; answers stay PEFT's (also with a device-slot limit)."""
    base, adapters, prompts, expected = setup
    runner = _runner(base, adapters, max_resident_loras=max_resident, max_cpu_loras=1)
    assert runner.lora.list_adapters() == [1, 2] and runner.lora.loaded_adapters() == [2]
    loaded: list[list[int]] = []
    assert _drive(_recording(runner, runner.lora.loaded_adapters, loaded), adapters, prompts,
                  max_loras=1) == expected
    assert max(len(ids) for ids in loaded) == 1 and {tuple(ids) for ids in loaded} >= {(1,), (2,)}
    assert runner.lora.num_loads >= 3  # both at add_adapter, then at least one read again
    assert not runner.lora.add_adapter(adapters[1])  # still registered, though not in memory
    assert runner.lora.remove_adapter(1) and runner.lora.list_adapters() == [2]


def _adapter_a_expectations(base, tmp_path, adapter_seed: int, prompt_seed: int,
                            **adapter) -> tuple[dict, list, dict]:
    """Adapter "a" (saved in tmp_path / "a" with ``adapter_seed`` and ``adapter``'s other arguments)
    and three prompts over a 251-token vocabulary: PEFT's greedy tokens for each, the second prompt
    adapted, the others on the base model (and the adapter must change the second's)."""
    adapters = {1: LoRARequest("a", 1, str(tmp_path / "a"))}
    rng = random.Random(prompt_seed)
    prompts = [[rng.randrange(251) for _ in range(rng.randrange(3, 20))] for _ in range(3)]
    adapted = peft_model(base, seed=adapter_seed, **adapter)
    expected = {f"r{i}": hf_greedy(adapted if i % 3 == 1 else load_hf(base), p, MAX_TOKENS)
                for i, p in enumerate(prompts)}
    assert expected["r1"] != hf_greedy(load_hf(base), prompts[1], MAX_TOKENS)
    return adapters, prompts, expected


def _assert_pefts_tokens(tmp_path: Path, kind: str, targets: tuple[str, ...], seed: int, prompt_seed: int,
                        **overrides) -> None:
    """A random ``kind`` model and a PEFT adapter of ``seed`` on ``targets``, served: PEFT's tokens."""
    base = save_tiny_model(tmp_path / "base", kind, vocab_size=251, **overrides)
    save_adapter(base, tmp_path / "a", seed=seed, targets=targets)
    adapters, prompts, expected = _adapter_a_expectations(base, tmp_path, adapter_seed=seed, prompt_seed=prompt_seed,
                                                          targets=targets)
    assert _drive(_worker(base, adapters).execute_model, adapters, prompts, max_loras=1) == expected


def test_an_adapter_on_a_moe_model_covers_attention_the_shared_expert_and_dense_layers(tmp_path):
    """An adapter on a Qwen2-MoE's linear projections (attention, the shared expert, the dense layer's
    MLP), not its routed experts: served, it gives PEFT's tokens. (PEFT 0.22 on, the bare names
    gate_proj / up_proj / down_proj also target the routed experts' stacked parameters: named by their
    modules here. Adapters on the routed experts: test_lora_experts.py.)"""
    from safetensors import safe_open

    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
               "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj")
    base = save_tiny_model(tmp_path / "base", "qwen2_moe", mlp_only_layers=[0], vocab_size=251)
    save_adapter(base, tmp_path / "a", seed=3, targets=targets)
    with safe_open(str(tmp_path / "a" / "adapter_model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(".mlp.shared_expert.gate_proj." in n for n in names)
    assert any(".layers.0.mlp.down_proj." in n for n in names)
    assert not any(".experts." in n for n in names)
    adapters, prompts, expected = _adapter_a_expectations(base, tmp_path, adapter_seed=3, prompt_seed=9,
                                                          targets=targets)
    assert _drive(_worker(base, adapters).execute_model, adapters, prompts, max_loras=1) == expected


def test_per_module_ranks_and_alphas_give_pefts_tokens(tmp_path):
    """rank_pattern / alpha_pattern (PEFT's per-module rank and alpha, matched at the end of a module's
    name): each module's own scaling."""
    settings = dict(rank_pattern={"q_proj": 4, r"layers\.1\.mlp\.down_proj": 2}, alpha_pattern={"v_proj": 32})
    base = save_tiny_model(tmp_path / "base", vocab_size=251)
    save_adapter(base, tmp_path / "a", seed=6, **settings)
    adapter = load_peft_adapter(tmp_path / "a", max_lora_rank=8)
    assert adapter.weights["model.layers.0.self_attn.q_proj"][0].shape[0] == 4
    assert adapter.scaling_of("model.layers.0.self_attn.q_proj") == 16.0 / 4
    assert adapter.scaling_of("model.layers.1.mlp.down_proj") == 16.0 / 2
    assert adapter.scaling_of("model.layers.0.mlp.down_proj") == adapter.scaling == 16.0 / 8
    assert adapter.scaling_of("model.layers.0.self_attn.v_proj") == 32.0 / 8
    adapters, prompts, expected = _adapter_a_expectations(base, tmp_path, adapter_seed=6, prompt_seed=4, **settings)
    assert _drive(_worker(base, adapters).execute_model, adapters, prompts, max_loras=1) == expected


def test_an_adapter_on_gemma2_gives_pefts_tokens(tmp_path):
    """Gemma 2's projections take adapters as Llama's do; its soft caps, four norms a layer and
    windowed layers stay as they are."""
    base = save_tiny_model(tmp_path / "base", "gemma2", vocab_size=251, attn_logit_softcapping=1.5)
    save_adapter(base, tmp_path / "a", seed=4)
    adapters, prompts, expected = _adapter_a_expectations(base, tmp_path, adapter_seed=4, prompt_seed=11)
    assert _drive(_worker(base, adapters).execute_model, adapters, prompts, max_loras=1) == expected


def test_an_adapter_on_deepseek_v2s_query_projection_gives_pefts_tokens(tmp_path):
    """DeepSeek-V2's query projection is its own (no fused q/k/v), and its rotary rows were reordered
    at load from pairs into halves: an adapter's B rows are reordered alike."""
    targets = ("q_proj", "o_proj")
    base = save_tiny_model(tmp_path / "base", "deepseek_v2", vocab_size=251)
    save_adapter(base, tmp_path / "a", seed=5, targets=targets)
    adapters, prompts, expected = _adapter_a_expectations(base, tmp_path, adapter_seed=5, prompt_seed=13,
                                                          targets=targets)
    assert _drive(_worker(base, adapters).execute_model, adapters, prompts, max_loras=1) == expected


def test_an_adapter_on_cohere_gives_pefts_tokens(tmp_path):
    """Command-R's query and key rows (and its per-head q/k norms) were reordered at load from RoPE's
    pairs into halves: an adapter's B rows on q_proj and k_proj are reordered alike."""
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    base = save_tiny_model(tmp_path / "base", "cohere", vocab_size=251, use_qk_norm=True)
    save_adapter(base, tmp_path / "a", seed=7, targets=targets)
    adapters, prompts, expected = _adapter_a_expectations(base, tmp_path, adapter_seed=7, prompt_seed=15,
                                                          targets=targets)
    assert _drive(_worker(base, adapters).execute_model, adapters, prompts, max_loras=1) == expected


def test_an_adapter_on_glm4_gives_pefts_tokens(tmp_path):
    """GLM-4's query and key rows were reordered at load from RoPE's pairs into halves over the rotary
    half of each head, and its checkpoint's fused gate/up projection split: an adapter's B rows on
    q_proj and k_proj are reordered alike, one on the fused gate_up_proj split as its weight."""
    targets = ("q_proj", "k_proj", "o_proj", "gate_up_proj", "down_proj")
    base = save_tiny_model(tmp_path / "base", "glm4", vocab_size=251)
    save_adapter(base, tmp_path / "a", seed=8, targets=targets)
    adapters, prompts, expected = _adapter_a_expectations(base, tmp_path, adapter_seed=8, prompt_seed=17,
                                                          targets=targets)
    assert _drive(_worker(base, adapters).execute_model, adapters, prompts, max_loras=1) == expected


@pytest.mark.parametrize("kind, targets, overrides", [
    ("arcee", ("q_proj", "up_proj", "down_proj"), {}),
    ("starcoder2", ("v_proj", "c_fc", "c_proj"), {}),
    ("llama4", ("q_proj", "k_proj", "gate_proj", "up_proj", "down_proj"), {}),
    ("phi", ("q_proj", "k_proj", "dense", "fc1", "fc2"), {}),
    ("gpt_neox", ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"), {}),
    ("gpt2", ("c_attn", "c_proj", "c_fc"), {}),
    ("gpt_bigcode", ("c_attn", "c_proj"), {"multi_query": False}),
    ("gptj", ("q_proj", "k_proj", "out_proj", "fc_in", "fc_out"), {}),
    ("opt", ("q_proj", "v_proj", "out_proj", "fc1", "fc2"), {}),
    ("falcon", ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
     {"new_decoder_architecture": True, "num_kv_heads": 2}),
    ("bloom", ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"), {}),
    ("mpt", ("Wqkv", "out_proj", "up_proj", "down_proj"), {}),
    ("minicpm5_moe", ("q_gate_proj", "k_proj", "o_proj", "gate_proj", "down_proj"), {}),
    ("minicpm3", ("q_proj", "o_proj", "down_proj"), {"q_lora_rank": None}),
    ("gemma3n", ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"), {}),
    ("gemma4", ("q_proj", "k_proj", "o_proj", "up_proj", "down_proj"), {"attention_k_eq_v": False}),
    ("mimo_v2_flash", ("q_proj", "v_proj", "o_proj"), {}),
    ("codegen", ("qkv_proj", "out_proj", "fc_in"), {}),
    ("lfm3", ("q_proj", "g_proj", "o_proj", "w1", "w2"), {}),
    ("nanochat", ("q_proj", "k_proj", "o_proj", "fc1", "fc2"), {}),
], ids=["arcee", "starcoder2", "llama4", "phi", "gpt_neox", "gpt2", "gpt_bigcode_multi_head", "gptj", "opt",
        "falcon_40b_style", "bloom", "mpt", "minicpm5_moe", "minicpm3", "gemma3n", "gemma4", "mimo_v2_flash",
        "codegen", "lfm3", "nanochat"])
def test_adapters_on_ungated_mlps_and_renamed_projections_give_pefts_tokens(tmp_path, kind, targets, overrides):
    """Arcee's, StarCoder2's, Phi's, GPT-NeoX's, the GPT family's and OPT's ungated MLPs (their
    projections looked up where LoRA wraps them), projections of other names (Llama 4's feed_forward:
    our mlp, its dense layers' and its shared expert's; Phi's and GPT-NeoX's dense, GPT-2's attn.c_proj,
    GPT-J's and OPT's out_proj: our o_proj; OPT's fc1 and fc2 beside its attention), fused q/k/v of
    their own layouts (GPT-NeoX's and BLOOM's query_key_value and a multi-head GPTBigCode's c_attn,
    each head's q, k and v together; Falcon-40B's, grouped by KV head; GPT-2's Conv1D c_attn, MPT's
    Wqkv: B's rows reordered as our qkv_proj's), q and k rows
    reordered from RoPE's pairs (Llama 4, GPT-J), MiniCPM5-MoE's q_gate_proj (transformers' name of
    its queries-and-gates projection: our q_proj), MiniCPM3's plain query projection (its rotary rows
    in halves already, B's as they are), Gemma 3n's (its KV-sharing layers' queries a projection of
    their own, no fused q/k/v), CodeGen's qkv_proj (four blocks of q, v, k rows: B's rows split as
    the weight's), LFM3's (transformers' g_proj: our gate_proj; feed_forward.w1 / w2: our MLP's),
    MiMo-V2-Flash's v_proj (B's rows padded per head to the keys' width, as
    the weight's), nanochat's q and k (B's rows' head halves swapped, as the weight's) and fc1 / fc2:
    each adapter gives PEFT's tokens."""
    _assert_pefts_tokens(tmp_path, kind, targets, 9, 19, **overrides)


# Models with recurrent layers and what their adapters train: attention, MLPs, shared experts, and the
# recurrent mixers' in_proj and out_proj (PEFT refuses out_proj on its "Mamba-based" models: Mamba-1,
# Mamba-2, Nemotron-H, Falcon-H1).
RECURRENT_ADAPTERS = {
    "granitemoehybrid": ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "input_linear",
                         "output_linear"),
    "bamba": ("q_proj", "v_proj", "gate_proj", "down_proj", "in_proj", "out_proj"),
    "falcon_h1": ("q_proj", "k_proj", "o_proj", "gate_proj", "down_proj", "in_proj"),
    "nemotron_h": ("q_proj", "o_proj", "up_proj", "down_proj", "in_proj"),
    "mamba": ("in_proj",),
    "jamba": ("q_proj", "o_proj", "in_proj", "out_proj"),
    "lfm2": ("q_proj", "out_proj", "in_proj", "w1", "w2"),
    "qwen3_next": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "minimax": ("q_proj", "k_proj", "v_proj", "o_proj"),
}


@pytest.mark.parametrize("kind", RECURRENT_ADAPTERS)
def test_adapters_on_models_with_recurrent_layers_give_pefts_tokens(tmp_path, kind):
    """Granite 4.0-H (its Mamba-2 mixers' in_proj and out_proj, its shared MLP's input_linear: our fused
    gate_up_proj, B's rows split into gate and up; output_linear: our down_proj), Bamba (feed_forward:
    our mlp), Falcon-H1 (B's rows scaled as its multipliers scaled the weights' at load), Nemotron-H and
    Mamba (backbone: our model), Jamba (Mamba-1 mixers), LFM2 (its short convolutions' in_proj and
    out_proj, its attention's out_proj: our o_proj), Qwen3-Next and MiniMax (their full-attention layers
    beside Gated DeltaNet and lightning attention): each adapter gives PEFT's tokens, the states each
    request carries computed under its adapter."""
    _assert_pefts_tokens(tmp_path, kind, RECURRENT_ADAPTERS[kind], 9, 19)


def test_an_adapter_whose_mixer_projection_is_shaped_for_another_model_is_refused(tmp_path):
    """A Mamba-2 mixer's in_proj B of more rows than the checkpoint's (an adapter of a model with wider
    states, say) is refused by name, not cut to the rows this model's loader picks."""
    from safetensors.torch import load_file, save_file

    base = save_tiny_model(tmp_path / "base", "granitemoehybrid", vocab_size=251)
    save_adapter(base, tmp_path / "a", seed=9, targets=("in_proj",))
    weights = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    [key] = [k for k in weights if k.endswith("layers.0.mamba.in_proj.lora_B.weight")]
    rows = weights[key].shape[0]
    weights[key] = torch.cat((weights[key], torch.zeros(16, weights[key].shape[1])))
    save_file(weights, str(tmp_path / "a" / "adapter_model.safetensors"))
    worker = _worker(base, {})
    with pytest.raises(ValueError, match=rf"mamba.in_proj do not fit the model \(lora_B has {rows + 16} outputs, "
                                         rf"the layer {rows}\)"):
        worker.add_lora(LoRARequest("a", 1, str(tmp_path / "a")))


@pytest.mark.slow
def test_tp2_over_gloo_shards_an_adapter_on_a_hybrids_mixers_as_their_weights(tmp_path, tp_hosts):
    """Granite 4.0-H over two ranks: each holds half the Mamba-2 heads (its rows of each part of in_proj,
    picked by the mixer's own loader) and the adapter's B rows for them, and out_proj's A columns for
    its heads; the answers are PEFT's."""
    import ray

    targets = RECURRENT_ADAPTERS["granitemoehybrid"]
    base = save_tiny_model(tmp_path / "base", "granitemoehybrid", vocab_size=251)
    save_adapter(base, tmp_path / "a", seed=9, targets=targets)
    adapters, prompts, expected = _adapter_a_expectations(base, tmp_path, adapter_seed=9, prompt_seed=19,
                                                          targets=targets)
    with two_tp_ranks(base, tp_hosts, device="cpu", dtype="float32", max_model_len=128, num_cpus=1,
                      max_lora_rank=8) as (ranks, execute):
        ray.get([w.initialize_cache.remote(60, 4) for w in ranks])
        assert ray.get([w.add_lora.remote(adapters[1]) for w in ranks]) == [True, True]
        assert _drive(execute, adapters, prompts, max_loras=1) == expected


def test_an_adapter_on_afmoes_attention_gate_gives_the_merged_models_tokens(tmp_path):
    """AFMoE names two projections gate_proj: the attention's output gate (a projection of its own) and a
    dense MLP's gate (a shard of our gate_up_proj). An adapter on both, and on q_proj, the MLP's up_proj
    and the shared expert's down_proj, gives the tokens transformers gives for the base weights with
    each B @ A x alpha / r added. (PEFT itself cannot write this adapter: its weight conversion takes
    any gate_proj for the routed experts' fused gate and up; so it is written in PEFT's format here.)"""
    import shutil

    from safetensors.torch import load_file, save_file

    base = save_tiny_model(tmp_path / "base", "afmoe", vocab_size=251)
    weights = load_file(str(base / "model.safetensors"))
    torch.manual_seed(5)
    rank, alpha = 8, 16.0
    modules = [f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("gate_proj", "q_proj")]
    modules += ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
                "model.layers.1.mlp.shared_experts.down_proj"]
    adapter, merged = {}, dict(weights)
    for module in modules:
        out_features, in_features = weights[f"{module}.weight"].shape
        a, b = torch.randn(rank, in_features) * 0.3, torch.randn(out_features, rank) * 0.3
        adapter[f"base_model.model.{module}.lora_A.weight"] = a
        adapter[f"base_model.model.{module}.lora_B.weight"] = b
        merged[f"{module}.weight"] = weights[f"{module}.weight"] + b @ a * (alpha / rank)
    (tmp_path / "a").mkdir()
    save_file(adapter, str(tmp_path / "a" / "adapter_model.safetensors"))
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": ["gate_proj", "q_proj", "up_proj",
                                                                               "down_proj"],
        "bias": "none", "base_model_name_or_path": str(base)}))
    shutil.copytree(base, tmp_path / "merged")
    save_file(merged, str(tmp_path / "merged" / "model.safetensors"), metadata={"format": "pt"})
    adapters = {1: LoRARequest("a", 1, str(tmp_path / "a"))}
    rng = random.Random(23)
    prompts = [[rng.randrange(251) for _ in range(rng.randrange(3, 20))] for _ in range(3)]
    expected = {f"r{i}": hf_greedy(load_hf(tmp_path / "merged" if i % 3 == 1 else base), p, MAX_TOKENS)
                for i, p in enumerate(prompts)}
    assert expected["r1"] != hf_greedy(load_hf(base), prompts[1], MAX_TOKENS)
    assert _drive(_worker(base, adapters).execute_model, adapters, prompts, max_loras=1) == expected


def test_gemma_adapters_of_the_vision_language_checkpoint_load_and_a_k_eq_v_key_adapter_is_refused(tmp_path):
    """An adapter trained on Gemma4ForConditionalGeneration names its modules under the language
    model's prefix (model.language_model.layers...) and may adapt the towers: it loads on the language
    model (the towers' modules left out) and gives the tokens of the same adapter named as the text
    model's. Under attention_k_eq_v an adapter on a full layer's k_proj, whose values are that
    projection too, is refused."""
    from safetensors.torch import load_file, save_file

    base = save_tiny_model(tmp_path / "base", "gemma4", vocab_size=251, attention_k_eq_v=False)
    plain = save_adapter(base, tmp_path / "plain", seed=9, targets=("q_proj", "o_proj", "down_proj"))
    multimodal = _edited_copy(plain, tmp_path / "multimodal")
    weights = {name.replace("base_model.model.model.", "base_model.model.model.language_model."): tensor
               for name, tensor in load_file(str(plain / "adapter_model.safetensors")).items()}
    weights["base_model.model.model.vision_tower.encoder.layers.0.q_proj.lora_A.weight"] = torch.zeros(8, 16)
    weights["base_model.model.model.vision_tower.encoder.layers.0.q_proj.lora_B.weight"] = torch.zeros(16, 8)
    save_file(weights, str(multimodal / "adapter_model.safetensors"))
    prompts = [[(5 * i + j) % 251 for i in range(9)] for j in range(3)]
    answers = []
    for path in (plain, multimodal):
        adapters = {1: LoRARequest("a", 1, str(path))}
        answers.append(_drive(_worker(base, adapters).execute_model, adapters, prompts, max_loras=1))
    assert answers[0] == answers[1]
    assert answers[0]["r1"] != _drive(_worker(base, {}).execute_model, {}, prompts, max_loras=1)["r1"]
    k_eq_v = save_tiny_model(tmp_path / "k_eq_v", "gemma4", vocab_size=251)
    adapter = save_adapter(k_eq_v, tmp_path / "keys", targets=("q_proj", "k_proj"))
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.k_proj .*attention_k_eq_v"):
        _worker(k_eq_v, {}).add_lora(LoRARequest("keys", 2, str(adapter)))


def test_an_adapter_on_phi3s_fused_projections_gives_pefts_tokens(tmp_path):
    """Phi-3's checkpoint, and so PEFT's adapters for it, hold q/k/v and gate/up fused
    (``qkv_proj``, ``gate_up_proj``): one A for the whole projection, B's rows in q, k, v order."""
    targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    base = save_tiny_model(tmp_path / "base", "phi3", num_key_value_heads=2, vocab_size=251)
    save_adapter(base, tmp_path / "a", seed=6, targets=targets)
    a = load_peft_adapter(tmp_path / "a", max_lora_rank=8)
    assert a.weights["model.layers.0.self_attn.qkv_proj"][1].shape == (64 + 2 * 32, 8)
    adapters = {1: LoRARequest("a", 1, str(tmp_path / "a"))}
    rng = random.Random(12)
    prompts = [[rng.randrange(251) for _ in range(rng.randrange(3, 20))] for _ in range(3)]
    adapted = peft_model(base, seed=6, targets=targets)
    expected = {f"r{i}": hf_greedy(adapted if i % 3 == 1 else load_hf(base), p, MAX_TOKENS)
                for i, p in enumerate(prompts)}
    assert expected["r1"] != hf_greedy(load_hf(base), prompts[1], MAX_TOKENS)
    assert _drive(_worker(base, adapters).execute_model, adapters, prompts, max_loras=1, budget=7) == expected


@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_a_fused_adapter_is_sharded_over_tp_ranks_as_its_parts_are(num_kv_heads):
    """On each of two TP ranks, a LoRA on the whole fused q/k/v (or gate/up) projection adds what
    the same A with B cut into q, k and v parts (the form PEFT gives Llama, checked against PEFT
    at TP 2 above) adds: a KV head replicated on both ranks (one KV head) or split between them."""
    from gpu_worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
    from gpu_worker.lora.manager import LoRAManager

    torch.manual_seed(0)
    x, rank = torch.randn(5, 64), 4
    # (the layer on TP rank r, its parts, their sizes)
    layers = [(lambda r: QKVParallelLinear(64, 16, 4, num_kv_heads, tp_rank=r, tp_size=2),
               ["q", "k", "v"], [4 * 16, num_kv_heads * 16, num_kv_heads * 16]),
              (lambda r: MergedColumnParallelLinear(64, [96, 96], tp_rank=r, tp_size=2), [0, 1], [96, 96])]
    for make, parts, sizes in layers:
        lora_a, lora_b = torch.randn(rank, 64), torch.randn(sum(sizes), rank)
        deltas = []
        for r in range(2):
            layer = make(r)
            fa, fb = LoRAManager._column_parallel(layer, {None: (lora_a, lora_b)})
            pa, pb = LoRAManager._column_parallel(layer, {s: (lora_a, b) for s, b in
                                                          zip(parts, lora_b.split(sizes), strict=True)})
            assert fa.shape == (rank, 64) and fb.shape == (layer.output_size_per_partition, rank)
            torch.testing.assert_close(x @ fa.T @ fb.T, x @ pa.T @ pb.T)
            deltas.append(x @ fa.T @ fb.T)
            # This rank's columns of the whole projection's delta: its share of each part (its query
            # heads and the KV head they use; its half of gate and of up).
            whole = (x @ lora_a.T @ lora_b.T).split(sizes, dim=1)
            if isinstance(layer, QKVParallelLinear):
                kv_head = r * num_kv_heads // 2
                mine = [whole[0][:, r * 32:(r + 1) * 32], *(w[:, kv_head * 16:(kv_head + 1) * 16] for w in whole[1:])]
            else:
                mine = [w[:, r * 48:(r + 1) * 48] for w in whole]
            torch.testing.assert_close(deltas[-1], torch.cat(mine, dim=1))
        assert not torch.equal(deltas[0], deltas[1])
        with pytest.raises(ValueError, match="fused layer"):
            LoRAManager._column_parallel(make(0), {None: (lora_a, lora_b[1:])})
        with pytest.raises(ValueError, match="fused projection and its parts"):
            LoRAManager._column_parallel(make(0), {None: (lora_a, lora_b), parts[0]: (lora_a, lora_b)})


def test_an_adapter_on_a_gemma3_vision_language_model_adapts_its_language_model(tmp_path, caplog):
    """Gemma 3 4B+ (Gemma3ForConditionalGeneration) is served as its text decoder: PEFT names the
    adapter's modules as the VLM has them (model.language_model.layers...), and with a plain target
    list also adapts the vision tower's q/v projections, which a text-only model cannot apply (as
    vLLM, they are skipped, with a warning naming them). The language model's part gives PEFT's tokens."""
    import logging

    from safetensors import safe_open

    targets = ("q_proj", "v_proj", "down_proj")
    base = save_tiny_model(tmp_path / "base", "gemma3_vlm", vocab_size=251)
    save_adapter(base, tmp_path / "a", seed=7, targets=targets)
    with safe_open(str(tmp_path / "a" / "adapter_model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.startswith("base_model.model.model.language_model.layers.0.") for n in names)
    assert any(".vision_tower." in n for n in names)
    adapters = {1: LoRARequest("a", 1, str(tmp_path / "a"))}
    rng = random.Random(28)  # (tokens below 247: not the image, begin- and end-of-image tokens)
    prompts = [[rng.randrange(247) for _ in range(rng.randrange(3, 20))] for _ in range(3)]
    adapted = peft_model(base, seed=7, targets=targets)
    expected = {f"r{i}": hf_greedy(adapted if i % 3 == 1 else load_hf(base), p, MAX_TOKENS)
                for i, p in enumerate(prompts)}
    assert expected["r1"] != hf_greedy(load_hf(base), prompts[1], MAX_TOKENS)
    with caplog.at_level(logging.WARNING, logger="gpu_worker.lora.manager"):
        worker = _worker(base, adapters)
    assert "model.vision_tower.encoder.layers.0.self_attn.q_proj" in caplog.text
    layers = worker.runner.lora.adapters[1].layers
    assert sorted(layers) == sorted(f"model.layers.{i}.{m}" for i in range(2)
                                    for m in ("self_attn.qkv_proj", "mlp.down_proj"))
    assert _drive(worker.execute_model, adapters, prompts, max_loras=1) == expected
    # (The tiny model repeats a token a prompt long, so tokens alone are a weak check: its logits too.)
    import numpy as np

    prompt = prompts[1]
    worker.runner.lora.set_batch([1], np.array([0, len(prompt)]))
    ours = prefill_logits(worker.runner, prompt, list(range((len(prompt) + 3) // 4)))
    with torch.no_grad():
        theirs = adapted(torch.tensor([prompt])).logits[0]
        plain = load_hf(base)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert (theirs - plain).abs().max() > 0.1


def test_an_adapter_with_only_vision_tower_modules_is_refused(tmp_path):
    """Nothing of it would apply to the text decoder: refused rather than served as the base model."""
    base = save_tiny_model(tmp_path / "base", "gemma3_vlm", vocab_size=251)
    save_adapter(base, tmp_path / "a", targets=("out_proj", "fc1"))  # SigLIP's names, not the decoder's
    worker = _worker(base, {})
    with pytest.raises(ValueError, match=r"vision tower .*out_proj"):
        worker.add_lora(LoRARequest("a", 1, str(tmp_path / "a")))
    assert worker.list_loras() == []


@pytest.mark.parametrize("init", ["orthogonal", "mica"])
def test_orthogonal_and_mica_initialised_adapters_give_pefts_tokens(tmp_path, init):
    """PEFT's orthogonal and MiCA inits set A and B only (the base weights stay as they are; MiCA
    freezes B in training) and apply as plain LoRA, B A x scaling: they are served as any other.
    (PiSSA, OLoRA and the like, which move part of W into A and B, stay refused, above.)"""
    from peft import LoraConfig, get_peft_model

    base = save_tiny_model(tmp_path / "base", num_key_value_heads=2, vocab_size=251)
    torch.manual_seed(8)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                        init_lora_weights=init)
    model = get_peft_model(load_hf(base), config)
    with torch.no_grad():
        for name, param in model.named_parameters():  # as if trained: both nonzero (MiCA starts A at 0)
            if "lora_" in name:
                param.add_(torch.randn_like(param) * 0.15)
    model.eval().save_pretrained(tmp_path / "a")
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["init_lora_weights"] == init
    adapters = {1: LoRARequest("a", 1, str(tmp_path / "a"))}
    rng = random.Random(14)
    prompts = [[rng.randrange(251) for _ in range(rng.randrange(3, 20))] for _ in range(3)]
    expected = {f"r{i}": hf_greedy(model if i % 3 == 1 else load_hf(base), p, MAX_TOKENS)
                for i, p in enumerate(prompts)}
    assert expected["r1"] != hf_greedy(load_hf(base), prompts[1], MAX_TOKENS)
    assert _drive(_worker(base, adapters).execute_model, adapters, prompts, max_loras=1) == expected
