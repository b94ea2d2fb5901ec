"""Pipeline parallelism: layers split into stages, each stage's workers holding only theirs, and
engines of several stages (of one or two tensor-parallel ranks each, as Ray worker actors) answering
exactly as one worker does."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest

from engine_core.config import EngineConfig, SchedulerConfig
from engine_core.outputs import EngineCoreRequest
from engine_core.sampling_params import SamplingParams
from gpu_worker import distributed
from gpu_worker.config import ModelConfig
from gpu_worker.models import build_model
from gpu_worker.weights import iter_safetensors, load_weights
from tests.gpu_worker.utils import save_tiny_model
from tests.tiny_model import build_tiny_llama


def test_layers_split_evenly_with_the_rest_before_the_last_stage():
    assert [distributed.pp_layer_range(4, r, 2) for r in range(2)] == [(0, 2), (2, 4)]
    assert [distributed.pp_layer_range(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [distributed.pp_layer_range(8, r, 3) for r in range(3)] == [(0, 3), (3, 6), (6, 8)]
    assert [distributed.pp_layer_range(3, r, 3) for r in range(3)] == [(0, 1), (1, 2), (2, 3)]
    assert distributed.pp_layer_range(7, 0, 1) == (0, 7)
    with pytest.raises(ValueError, match="fewer than pipeline_parallel_size"):
        distributed.pp_layer_range(2, 0, 3)


def test_a_layer_partition_gives_each_stage_its_count(monkeypatch):
    """vLLM's VLLM_PP_LAYER_PARTITION: each stage's layer count, first stage first."""
    assert [distributed.pp_layer_range(6, r, 2, (1, 5)) for r in range(2)] == [(0, 1), (1, 6)]
    assert [distributed.pp_layer_range(6, r, 3, (3, 2, 1)) for r in range(3)] == [(0, 3), (3, 5), (5, 6)]
    for bad in ((3, 2), (6, 0), (2, 2, 2)):
        with pytest.raises(ValueError, match="layer partition"):
            distributed.pp_layer_range(6, 0, 2, bad)
    # Read where the engines' configs are made (once: a config made again elsewhere keeps its own).
    from cluster.config import ClusterConfig, EngineSpec

    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,5")
    [config] = ClusterConfig(model="m", defaults=EngineSpec(pipeline_parallel_size=2)).engine_configs()
    assert config.pp_layer_partition == (1, 5)
    assert ClusterConfig(model="m").engine_configs()[0].pp_layer_partition is None  # (one stage: nothing to split)
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION")
    assert dataclasses.replace(config, seed=1).pp_layer_partition == (1, 5)
    assert dataclasses.replace(config, pp_layer_partition=None).pp_layer_partition is None
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,x")
    with pytest.raises(ValueError, match="comma-separated layer counts"):
        ClusterConfig(model="m", defaults=EngineSpec(pipeline_parallel_size=2)).engine_configs()
    with pytest.raises(ValueError, match="pp_layer_partition"):
        EngineConfig(model="m", pipeline_parallel_size=2, pp_layer_partition=(6,))
    # A stage's range with its rank and size given takes its group's partition too.
    distributed._group = distributed.TPGroup(pp_rank=1, pp_size=2, layer_partition=(1, 5))
    try:
        assert distributed.pp_layer_range(6, 1, 2) == distributed.pp_layer_range(6) == (1, 6)
        assert distributed.pp_layer_range(6, 1, 3) == (2, 4)  # (another size: an even split)
    finally:
        distributed._group = distributed.TPGroup()


@pytest.fixture
def stage():
    """Act as one stage of a pipeline (no process group: construction and loading only)."""
    def enter(pp_rank: int, pp_size: int) -> None:
        distributed._group = distributed.TPGroup(pp_rank=pp_rank, pp_size=pp_size)

    yield enter
    distributed._group = distributed.TPGroup()


@pytest.mark.parametrize("tie", [False, True])
def test_each_stage_builds_and_loads_only_its_layers(tmp_path, stage, tie):
    model_dir = build_tiny_llama(tmp_path, num_layers=3, tie=tie)
    config = ModelConfig.from_pretrained(model_dir)
    names = []
    for pp_rank in range(2):
        stage(pp_rank, 2)
        model = build_model(config)
        load_weights(model, iter_safetensors(model_dir))  # (raises on a tensor it cannot place or one it lacks)
        names.append({name for name, _ in model.named_parameters()})
        assert len(model.attention_layers()) == (2, 1)[pp_rank]
    first, last = names
    assert {n.split(".")[2] for n in first if n.startswith("model.layers.")} == {"0", "1"}
    assert {n.split(".")[2] for n in last if n.startswith("model.layers.")} == {"2"}
    assert "model.embed_tokens.weight" in first and not any(n.startswith(("model.norm.", "lm_head.")) for n in first)
    assert "model.norm.weight" in last
    # The last stage's head: its own weights, or (tied) the embedding's, which it then holds too.
    assert ("model.embed_tokens.weight" in last) == tie and ("lm_head.weight" in last) != tie
    # Together the stages hold every parameter of the whole model, once.
    stage(0, 1)
    whole = {name for name, _ in build_model(config).named_parameters()}
    assert first | last == whole and (not (first & last) or tie)


@pytest.mark.parametrize("kind, added", [("gpt2", "model.embed_positions.weight"),
                                         ("bloom", "model.embed_norm.weight")])
def test_what_is_added_to_the_embeddings_is_the_first_stages_alone(tmp_path, stage, kind, added):
    """GPT-2's learned positions and BLOOM's LayerNorm over the embeddings belong to the first stage: the
    last, which holds the tied embedding for its head, neither builds nor loads them."""
    model_dir = save_tiny_model(tmp_path, kind, num_hidden_layers=3)
    config = ModelConfig.from_pretrained(model_dir)
    names = []
    for pp_rank in range(2):
        stage(pp_rank, 2)
        model = build_model(config)
        load_weights(model, iter_safetensors(model_dir))
        names.append({name for name, _ in model.named_parameters()})
    first, last = names
    assert added in first and added not in last and "model.embed_tokens.weight" in last
    stage(0, 1)
    assert first | last == {name for name, _ in build_model(config).named_parameters()}


# -- engines of several stages on Ray ------------------------------------------------------------


def _engine(model_dir, num_gpu_blocks: int = 48, **overrides: Any):
    from engine_core.engine_core import EngineCore
    from gpu_worker.executor import create_executor

    config = EngineConfig(model=str(model_dir), num_gpu_blocks=num_gpu_blocks, num_cpus_per_worker=0.5,
                          scheduler=SchedulerConfig(max_model_len=256, max_num_batched_tokens=64), **overrides)
    return EngineCore(config, create_executor(config))


def _run(engine, requests: list[EngineCoreRequest], timeout: float = 120.0) -> dict[str, dict[str, Any]]:
    for request in requests:
        engine.add_request(request)
    results: dict[str, dict[str, Any]] = {r.request_id: {"tokens": [], "logprobs": []} for r in requests}
    deadline = time.monotonic() + timeout
    while any("finish" not in r for r in results.values()) and time.monotonic() < deadline:
        for eco in engine.step().values():
            for out in eco.outputs:
                result = results[out.request_id]
                result["tokens"] += out.new_token_ids
                if out.new_logprobs is not None:
                    result["logprobs"] += out.new_logprobs.sampled_logprobs
                if out.finish_reason is not None:
                    result["finish"] = out.finish_reason
                    result["params"] = out.kv_transfer_params
    return results


def _requests() -> list[EngineCoreRequest]:
    """Greedy and seeded requests together; prompts longer than a pass's token budget (chunked)."""
    prompts = [[(7 * i + 3 * k) % 200 + 5 for i in range(n)] for k, n in enumerate((90, 23, 5, 150))]
    return [EngineCoreRequest(request_id=f"r{k}", prompt_token_ids=prompt,
                              sampling_params=SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0,
                                                             **({"temperature": 0.0} if k % 2 == 0 else
                                                                {"temperature": 0.8, "seed": k})))
            for k, prompt in enumerate(prompts)]


def _one_workers_answers(model_dir, num_gpu_blocks: int) -> dict[str, dict[str, Any]]:
    """_requests()' answers from an engine of one worker (what the parallel engines must equal)."""
    single = _engine(model_dir, num_gpu_blocks)
    try:
        return _run(single, _requests())
    finally:
        single.shutdown()


def _assert_same_answers(got: dict[str, dict[str, Any]], expected: dict[str, dict[str, Any]]) -> None:
    for rid, want in expected.items():
        assert got[rid]["tokens"] == want["tokens"] and len(want["tokens"]) == 12, rid
        assert got[rid]["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4), rid


@pytest.mark.parametrize("tp,pp,num_layers,tie,blocks,partition", [
    (1, 2, 3, True, 16, None), (1, 3, 3, False, 16, None), (2, 2, 4, False, 48, None), (1, 2, 4, False, 48, (3, 1))])
def test_an_engine_of_several_stages_answers_as_one_worker_does(ray_cluster, tmp_path, tp, pp, num_layers, tie,
                                                                blocks, partition):
    """Passes overlap (one in each stage at once), through chunked prefills and, with 16 blocks,
    preemptions of requests whose pass is still in flight."""
    model_dir = build_tiny_llama(tmp_path, num_layers=num_layers, tie=tie)
    expected = _one_workers_answers(model_dir, blocks)
    staged = _engine(model_dir, blocks, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                     pp_layer_partition=partition)
    in_flight: list[int] = []
    start = staged.executor.execute_model_async

    def counted(scheduler_output):
        future = start(scheduler_output)
        in_flight.append(len(staged._batch_queue) + 1)
        return future

    staged.executor.execute_model_async = counted
    try:
        assert len(staged.executor.workers) == tp * pp
        if partition is not None:  # (each stage built its count of layers)
            import ray

            held = ray.get([w.__ray_call__.remote(lambda w: len(w.runner.model.attention_layers()))
                            for w in staged.executor.workers])
            assert tuple(held) == partition
        got = _run(staged, _requests())
        _assert_same_answers(got, expected)
        assert max(in_flight) == pp
        if blocks == 16:
            assert staged.stats().num_preemptions > 0, "16 blocks were meant to force preemptions"
        # The engine steps on while passes are in flight (the last tells the workers who finished),
        # then has nothing left; every block went back to the pool.
        while staged.has_work():
            staged.step()
        assert staged.stats().num_free_blocks == blocks and not staged._batch_queue
    finally:
        staged.shutdown()


def test_two_stages_keep_a_share_of_each_kv_cache_group_and_answer_as_one_worker_does(ray_cluster, tmp_path):
    """Gemma 3's pattern in 6 layers (every third full: layers 2 and 5 full, 4 windowed of 8 keys) over two
    stages of 1 and 5 layers (VLLM_PP_LAYER_PARTITION), under the hybrid KV cache manager: each group takes
    at most a layer from each stage (two full groups, three windowed: the engine and both stages plan
    alike), so each stage keeps one shared tensor (one worker keeps two), and the engine answers as one
    worker does, through prompts past the window; every block goes back to the pool."""
    import ray

    from engine_core.core.kv_cache_utils import AttentionWindow
    from tests.tiny_model import build_tokenizer

    model_dir = save_tiny_model(tmp_path, "gemma3", num_hidden_layers=6, sliding_window_pattern=3,
                                max_position_embeddings=256)
    build_tokenizer().save_pretrained(model_dir)
    expected = _one_workers_answers(model_dir, 64)
    staged = _engine(model_dir, 64, pipeline_parallel_size=2, pp_layer_partition=(1, 5))
    try:
        assert staged.model_info.kv_cache_groups == (None, None, *[AttentionWindow(8)] * 3)
        tensors = ray.get([w.__ray_call__.remote(lambda w: len({c[0].data_ptr() for c in w.runner.kv_caches}))
                           for w in staged.executor.workers])
        assert tensors == [1, 1]
        _assert_same_answers(_run(staged, _requests()), expected)
        while staged.has_work():
            staged.step()
        assert staged.stats().num_free_blocks == 64
    finally:
        staged.shutdown()


def test_a_worker_refuses_what_pipeline_stages_do_not_serve(tmp_path):
    from gpu_worker.worker import Worker
    from tests.tiny_model import build_tiny_embedder

    with pytest.raises(ValueError, match="not among"):
        Worker(rank=2, world_size=1, model_path_or_config=build_tiny_llama(tmp_path / "m"), device="cpu",
               pipeline_parallel_size=2)
    worker = Worker(rank=0, world_size=1, model_path_or_config=build_tiny_embedder(tmp_path / "e"), device="cpu",
                    pipeline_parallel_size=2)
    distributed._group = distributed.TPGroup(pp_rank=0, pp_size=2)
    try:
        with pytest.raises(ValueError, match="pipeline parallelism serves generative decoders"):
            worker.load_model()
    finally:
        distributed._group = distributed.TPGroup()


def test_an_engine_refuses_stages_its_model_cannot_have(ray_cluster, tmp_path):
    from gpu_worker.executor import create_executor
    from tests.tiny_model import build_tiny_embedder

    for model_dir, pp, message in ((build_tiny_llama(tmp_path / "m"), 3, "has only 2 layers"),
                                   (build_tiny_embedder(tmp_path / "e"), 2, "serves generative decoders")):
        with pytest.raises(ValueError, match=message):
            create_executor(EngineConfig(model=str(model_dir), num_gpu_blocks=8, pipeline_parallel_size=pp))
    with pytest.raises(ValueError, match=r"partition \[2, 1\] \(VLLM_PP_LAYER_PARTITION\) has 3 layers"):
        create_executor(EngineConfig(model=str(tmp_path / "m"), num_gpu_blocks=8, pipeline_parallel_size=2,
                                     pp_layer_partition=(2, 1)))


def test_an_adapter_on_an_engine_of_two_stages_answers_as_peft_does(ray_cluster, tiny_model_dir, tmp_path):
    """Each stage loads its own layers' part of a LoRA adapter (the offline LLM, on Ray)."""
    from cluster import LLM, LoRARequest
    from cluster import SamplingParams as OfflineSamplingParams
    from tests.lora_adapters import peft_greedy, save_adapter

    prompts = ["Hello world", "Paris is the capital of"]
    adapter = save_adapter(tiny_model_dir, tmp_path / "a", seed=5)
    expected = peft_greedy(tiny_model_dir, prompts, 8, seed=5)
    with LLM(model=str(tiny_model_dir), pipeline_parallel_size=2, num_gpu_blocks=64, enable_lora=True,
             max_model_len=256, num_cpus_per_worker=0.5) as llm:
        outs = llm.generate(prompts, OfflineSamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                            use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapter)))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_three_passes_in_flight_under_preemption_answer_as_one_pass_at_a_time(tiny_model_dir):
    """The batch queue's scheduling alone (one in-process worker that takes three passes "in
    flight", computing each as it is sent): a request preempted while an earlier pass holds its next
    token (and, blocks freed by an abort, admitted again at once) gets that token before it runs
    again; the others get the same tokens as with one pass at a time."""
    from engine_core.engine_core import EngineCore
    from gpu_worker.executor import UniProcExecutor

    aborted: list[str] = []
    engines: list[Any] = []

    class ThreePasses(UniProcExecutor):
        max_concurrent_batches = 3

        def execute_model_async(self, scheduler_output):
            future = super().execute_model_async(scheduler_output)
            preempted = scheduler_output.preempted_req_ids
            if preempted and not aborted:  # (a client leaves between passes: its blocks are free at once)
                others = [r for r in engines[0].scheduler.running if r.request_id not in preempted]
                victim = max(others, key=lambda r: r.num_computed_tokens)
                engines[0].abort_requests([victim.request_id])
                aborted.append(victim.request_id)
            return future

    def engine(executor_class):
        config = EngineConfig(model=str(tiny_model_dir), num_gpu_blocks=8, executor_backend="uni",
                              scheduler=SchedulerConfig(max_model_len=128, max_num_batched_tokens=32))
        return EngineCore(config, executor_class(config))

    def requests() -> list[EngineCoreRequest]:
        # (Short prompts, long answers, 8 blocks: decodes preempted while their previous pass is in flight.)
        return [EngineCoreRequest(request_id=f"q{k}", prompt_token_ids=[(5 * i + 7 * k) % 200 + 5 for i in range(10)],
                                  sampling_params=SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
                for k in range(6)]

    plain = engine(UniProcExecutor)
    queued = engine(ThreePasses)
    engines.append(queued)
    try:
        assert queued._max_batches == 3
        expected = _run(plain, requests())
        for request in requests():
            queued.add_request(request)
        got: dict[str, list[int]] = {}
        deadline = time.monotonic() + 60
        while queued.has_work() and time.monotonic() < deadline:
            for eco in queued.step().values():
                for out in eco.outputs:
                    got.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert aborted and queued.stats().num_preemptions > 0
        assert {rid: tokens for rid, tokens in got.items() if rid not in aborted} == \
            {rid: r["tokens"] for rid, r in expected.items() if rid not in aborted}
        assert queued.stats().num_free_blocks == 8
    finally:
        plain.shutdown()
        queued.shutdown()


def test_a_request_id_added_again_while_its_old_pass_is_in_flight_gets_only_its_own_tokens(tiny_model_dir):
    from engine_core.engine_core import EngineCore
    from gpu_worker.executor import UniProcExecutor

    class TwoPasses(UniProcExecutor):
        max_concurrent_batches = 2

    def request(prompt: list[int]) -> EngineCoreRequest:
        return EngineCoreRequest(request_id="same", prompt_token_ids=prompt,
                                 sampling_params=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))

    old, new = [(3 * i) % 200 + 5 for i in range(12)], [(11 * i) % 200 + 7 for i in range(20)]
    config = EngineConfig(model=str(tiny_model_dir), num_gpu_blocks=16, executor_backend="uni",
                          scheduler=SchedulerConfig(max_model_len=128))
    plain, queued = EngineCore(config, UniProcExecutor(config)), EngineCore(config, TwoPasses(config))
    try:
        expected = _run(plain, [request(new)])["same"]["tokens"]
        queued.add_request(request(old))
        queued.add_request(EngineCoreRequest(request_id="other", prompt_token_ids=old[:5],
                                             sampling_params=SamplingParams(max_tokens=30, ignore_eos=True)))
        queued.step()  # (the old request's prefill, in flight: nothing taken in yet)
        assert len(queued._batch_queue) == 1
        queued.abort_requests(["same"])
        queued.add_request(request(new))
        tokens: list[int] = []
        deadline = time.monotonic() + 60
        while queued.has_work() and time.monotonic() < deadline:
            for eco in queued.step().values():
                tokens += [t for out in eco.outputs if out.request_id == "same" for t in out.new_token_ids]
        assert tokens == expected
    finally:
        plain.shutdown()
        queued.shutdown()


def test_two_stage_engines_sleep_and_hand_a_prompts_kv_on(ray_cluster, tiny_model_dir):
    """Each stage releases and restores its own weights and cache (sleep level 2 reads its layers
    again); a prompt computed on one two-stage engine is decoded on another, each worker reading
    its own layers' blocks from the same worker of the producer."""
    from tests.engine_core.test_kv_transfer import reading_from

    prompt = [(13 * i + 2) % 200 + 5 for i in range(37)]

    def request(rid: str, max_tokens: int, params: dict[str, Any] | None = None) -> EngineCoreRequest:
        return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, kv_transfer_params=params,
                                 sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                ignore_eos=True))

    producer = _engine(tiny_model_dir, pipeline_parallel_size=2, enable_sleep_mode=True,
                       kv_transfer_config=_transfer("kv_producer"))
    consumer = _engine(tiny_model_dir, pipeline_parallel_size=2, kv_transfer_config=_transfer("kv_consumer"))

    consumer.kv_fetcher = reading_from(producer)
    try:
        expected = _run(producer, [request("whole", 8)])["whole"]["tokens"]
        producer.reset_prefix_cache()
        producer.sleep(2)
        producer.wake_up()
        assert _run(producer, [request("again", 8)])["again"]["tokens"] == expected
        producer.reset_prefix_cache()
        prefill = _run(producer, [request("p", 1, {"do_remote_decode": True})])["p"]
        params = prefill["params"]
        decoded = _run(consumer, [request("d", 8, params)])["d"]
        assert decoded["tokens"] == expected and consumer.stats().kv_transfer_received_blocks == 3
    finally:
        producer.shutdown()
        consumer.shutdown()


def _transfer(role: str):
    from engine_core.kv_transfer import KVTransferConfig

    return KVTransferConfig(kv_role=role)  # type: ignore[arg-type]


def test_gemma3s_vision_language_checkpoint_serves_its_language_model_in_stages(tmp_path, stage):
    """Gemma 3 4B+ under pipeline parallelism: its language model alone (as before its images were
    served; the tower is not split into stages), each stage loading its layers and skipping the
    vision side's tensors."""
    from gpu_worker.models.llama import pipeline_refusal
    from tests.tiny_model import build_tiny_gemma3_vl

    model_dir = build_tiny_gemma3_vl(tmp_path)
    assert ModelConfig.from_pretrained(model_dir).vision is not None
    config = ModelConfig.from_pretrained(model_dir, pipeline_stages=True)
    assert config.vision is None and pipeline_refusal(config, 2) is None
    for pp_rank in range(2):
        stage(pp_rank, 2)
        model = build_model(config)
        load_weights(model, iter_safetensors(model_dir))  # (raises on a tensor it cannot place or one it lacks)
        assert not any(name.startswith(("vision_tower.", "multi_modal_projector.")) for name, _ in
                       model.named_parameters())


def test_glm5s_stages_each_start_at_a_layer_choosing_its_own_keys(tmp_path, stage):
    """GLM-5's layers that share an earlier layer's choice of keys cannot start a stage (the choice is
    made on another): four layers (full, shared, full, shared) split 2 + 2 build, 1 + 3 is refused."""
    from tests.gpu_worker.utils import save_tiny_model

    config = ModelConfig.from_pretrained(save_tiny_model(tmp_path, "glm_moe_dsa", num_hidden_layers=4))
    assert config.indexer_shared_layers == (False, True, False, True)
    for pp_rank in range(2):
        stage(pp_rank, 2)
        build_model(config)
    distributed._group = distributed.TPGroup(pp_rank=1, pp_size=2, layer_partition=(1, 3))
    with pytest.raises(ValueError, match=r"stage of layers 1\.\.3 starts with a layer sharing"):
        build_model(config)


@pytest.mark.parametrize("kind", ["granitemoehybrid", "qwen3_next", "kimi_linear", "bailing_hybrid", "minimax", "jamba",
                                  "falcon_h1", "lfm2", "olmo_hybrid"])
def test_an_engine_of_two_stages_with_recurrent_layers_answers_as_one_worker_does(ray_cluster, tmp_path, kind):
    """Each stage keeps its own recurrent layers' states (Mamba-2, Gated DeltaNet, Kimi Delta Attention
    with MLA, lightning attention, Mamba-1 with experts, Falcon-H1's attention and Mamba-2 side by side,
    LFM2's short convolutions): greedy and seeded answers, logprobs included,
    equal one worker's through chunked prefills and preemptions, passes in flight in both stages (a
    stage may hold recurrent layers alone: Kimi-Linear's second)."""
    from tests.gpu_worker.utils import save_tiny_model
    from tests.tiny_model import build_tokenizer

    model_dir = save_tiny_model(tmp_path, kind)
    build_tokenizer().save_pretrained(model_dir)
    expected = _one_workers_answers(model_dir, 16)
    staged = _engine(model_dir, 16, pipeline_parallel_size=2)
    try:
        import ray

        from gpu_worker.config import ModelConfig

        held = ray.get([w.__ray_call__.remote(lambda w: len(w.runner.mamba_mixers)) for w in staged.executor.workers])
        layers = ModelConfig.from_pretrained(model_dir).mamba_layers
        assert held == [sum(layers[:2]), sum(layers[2:])]  # (each stage its own layers' mixers)
        got = _run(staged, _requests())
        _assert_same_answers(got, expected)
        assert staged.stats().num_preemptions > 0, "16 blocks were meant to force preemptions"
    finally:
        staged.shutdown()


@pytest.mark.parametrize("kind, overrides, parallel", [
    ("granitemoehybrid", {}, {"pipeline_parallel_size": 2}), ("kimi_linear", {}, {"pipeline_parallel_size": 2}),
    ("granitemoehybrid", {"layer_types": ["attention", "attention", "mamba", "mamba"]}, {"pipeline_parallel_size": 2}),
    ("granitemoehybrid", {}, {"tensor_parallel_size": 2})])
def test_stages_and_tensor_ranks_keep_and_restore_their_own_recurrent_states(ray_cluster, tmp_path, kind,
                                                                              overrides, parallel):
    """--mamba-cache-mode align over two stages, passes in flight in both: each stage saves and restores
    its own layers' kept states, in the order the passes come (a state saved by one pass is restored by
    a later one; a stage of attention layers alone keeps none); and over two tensor-parallel ranks, each
    its own heads' states. The same prompts again start from them, and the answers stay one worker's
    without prefix caching."""
    from tests.gpu_worker.utils import save_tiny_model
    from tests.tiny_model import build_tokenizer

    model_dir = save_tiny_model(tmp_path, kind, **overrides)
    build_tokenizer().save_pretrained(model_dir)
    expected = _one_workers_answers(model_dir, 64)
    staged = _engine(model_dir, 64, mamba_cache_mode="align", **parallel)
    try:
        first = _run(staged, _requests())
        hits_before = staged.stats().prefix_cache_hits
        again = _run(staged, _requests())
        stats = staged.stats()
    finally:
        staged.shutdown()
    _assert_same_answers(first, expected)
    _assert_same_answers(again, expected)
    # (Each prompt again, from its last full block of 16: 80 + 16 + 0 + 144 tokens.)
    assert stats.prefix_cache_hits - hits_before == 240


def test_a_later_stage_of_a_hybrid_profiles_and_sizes_only_what_it_keeps(tmp_path, stage, monkeypatch):
    """A hybrid's second stage (its last two layers: recurrent alone) runs the memory profile's
    passes from zero hidden states, not token ids; its blocks cost nothing and report no bound (the
    first stage's, one attention layer's, set the count); the states counted are its own layers'."""
    from gpu_worker.worker import NO_BLOCK_BOUND, Worker
    from tests.gpu_worker.utils import save_tiny_model
    from tests.tiny_model import build_tokenizer

    model_dir = save_tiny_model(tmp_path, "granitemoehybrid", layer_types=["mamba", "attention", "mamba", "mamba"])
    build_tokenizer().save_pretrained(model_dir)
    monkeypatch.setattr(distributed, "all_reduce_min", lambda value, device="cpu": value)  # (each stage's own)
    sizes = []
    for pp_rank in range(2):
        stage(pp_rank, 2)
        worker = Worker(rank=pp_rank, world_size=1, model_path_or_config=str(model_dir), device="cpu",
                        pipeline_parallel_size=2, max_model_len=64, max_num_seqs=4)
        worker.load_model()
        worker.runner.profile_run(16)  # (the recurrent decodes' pass included)
        sizes.append((worker.bytes_per_block(16), worker.mamba_state_bytes(),
                      worker.determine_num_blocks(16, kv_cache_memory_bytes=1 << 24)))
    (first_block, first_states, first_blocks), (last_block, last_states, last_blocks) = sizes
    assert first_block > 0 and last_block == 0 and last_blocks == NO_BLOCK_BOUND
    assert last_states == 2 * first_states  # (two recurrent layers against one)
    assert first_blocks == ((1 << 24) - first_states) // first_block
