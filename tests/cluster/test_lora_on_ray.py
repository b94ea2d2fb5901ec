"""LoRA on an engine whose tensor-parallel workers are Ray actors: loaded on every rank, and loaded
again when the engine brings dead workers back."""

from __future__ import annotations

import time

import pytest

from cluster import LLM, LoRARequest, SamplingParams
from tests.lora_adapters import peft_greedy, save_adapter
from tests.serve_cluster import wait_until_healthy

pytestmark = pytest.mark.slow

PROMPTS = ["Hello world", "Paris is the capital of", "def main():\n    return 42\n"]


def _wait_until_dead(actor, timeout_s: float = 30.0) -> None:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=1.0)
        except RayActorError:
            return
        except GetTimeoutError:
            pass
        time.sleep(0.05)
    raise AssertionError("the killed worker is still alive")


def test_tp2_engine_serves_an_adapter_and_keeps_it_across_a_worker_restart(ray_cluster, tiny_model_dir, tmp_path):
    import ray

    adapter = save_adapter(tiny_model_dir, tmp_path / "a", seed=21)
    expected = peft_greedy(tiny_model_dir, PROMPTS, 8, seed=21)
    lora = LoRARequest("a", 1, str(adapter))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(tiny_model_dir), tensor_parallel_size=2, num_gpu_blocks=64, enable_lora=True,
              max_model_len=256)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False,
                                                               lora_request=lora)] == expected
        actor = llm._handles[0].actor

        def rank1():
            return ray.get(actor.__ray_call__.remote(lambda self: self.service.engine.executor.workers[1]))

        worker = rank1()
        ray.kill(worker, no_restart=True)
        _wait_until_dead(worker)  # ray.kill only asks
        # The first pass that finds rank 1 dead fails what it carries and the engine starts new workers.
        # That pass is this generate's, or one the engine ran after the last generate answered (the
        # one that tells the workers which requests finished): so this answer is an error or PEFT's.
        after = llm.generate(PROMPTS[:1], params, use_tqdm=False, lora_request=lora)[0].outputs[0]
        assert after.finish_reason == "error" or after.token_ids == expected[0], after
        wait_until_healthy(actor)
        assert rank1()._actor_id != worker._actor_id  # new workers
        # The engine loaded the adapter on them again (the LLM did not ask).
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False,
                                                               lora_request=lora)] == expected
    finally:
        llm.shutdown()
