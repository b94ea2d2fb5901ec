"""An adapter reloaded in place (load_inplace): new requests get the new weights at once, the
requests already running under the earlier load finish with theirs, and the earlier load is
unloaded when they are done. A real engine with the tiny model, checked against PEFT's models."""

from __future__ import annotations

import pytest

from cluster.config import ClusterConfig, EngineSpec
from engine_core.engine_core import EngineCore
from engine_core.lora import LoRANotLoadedError
from engine_core.outputs import EngineCoreRequest, LoRARequest
from engine_core.sampling_params import SamplingParams
from gpu_worker.executor import create_executor
from tests.gpu_worker.utils import hf_greedy
from tests.lora_adapters import peft_model, save_adapter
from tests.tiny_model import build_tiny_llama

PROMPT = [5, 17, 42, 9, 88, 23, 61]
MAX_TOKENS = 6


def _request(rid: str, lora: LoRARequest) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=PROMPT, client_index=0, lora_request=lora,
                             sampling_params=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0))


def _step(engine: EngineCore, tokens: dict[str, list[int]]) -> None:
    for eco in engine.step().values():
        for out in eco.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)


def test_an_in_place_reload_serves_new_requests_the_new_weights_and_lets_running_ones_finish(tmp_path):
    base = build_tiny_llama(tmp_path / "base")
    kwargs = {"old": dict(seed=21, r=4), "new": dict(seed=22, r=4)}
    paths = {name: save_adapter(base, tmp_path / name, **kw) for name, kw in kwargs.items()}
    expected = {name: hf_greedy(peft_model(base, **kw), PROMPT, MAX_TOKENS) for name, kw in kwargs.items()}
    assert expected["old"] != expected["new"]
    [config] = ClusterConfig(model=str(base), defaults=EngineSpec(num_gpu_blocks=64, max_model_len=128),
                             enable_lora=True, max_loras=2, max_lora_rank=8).engine_configs()
    engine = EngineCore(config, create_executor(config))
    try:
        old, new = LoRARequest("x", 100, str(paths["old"])), LoRARequest("x", 101, str(paths["new"]))
        assert engine.add_lora(old)
        tokens: dict[str, list[int]] = {}
        engine.add_request(_request("running", old))
        _step(engine, tokens)  # (its prompt and first token under the old weights)
        with pytest.raises(ValueError, match="named 'x' is already loaded"):
            engine.add_lora(new)  # (a second adapter of one name only as its replacement)
        assert engine.add_lora(new, replacing=old.lora_int_id)
        assert engine.list_loras() == [new]  # (the new load alone is listed from its load on)
        assert engine.remove_lora(new.lora_int_id) and engine.list_loras() == [old]  # (a reload undone)
        assert engine.add_lora(new, replacing=old.lora_int_id)
        assert engine.retire_lora(old.lora_int_id)
        assert engine.list_loras() == [new] and set(engine.loras) == {100, 101}  # (still in use)
        with pytest.raises(LoRANotLoadedError):
            engine.check_lora(_request("late", old))  # (a router that still names the earlier load)
        engine.check_lora(_request("fresh", new))
        engine.add_request(_request("fresh", new))
        while engine.scheduler.has_unfinished_requests():
            _step(engine, tokens)
        assert tokens == {"running": expected["old"], "fresh": expected["new"]}
        assert set(engine.loras) == {101} and engine.retired_loras == set()  # unloaded once it finished
        # A further reload of the name while the first is unused: the earlier load goes at once.
        newer = LoRARequest("x", 102, str(paths["old"]))
        assert engine.add_lora(newer, replacing=new.lora_int_id) and engine.retire_lora(new.lora_int_id)
        assert set(engine.loras) == {102} and engine.list_loras() == [newer]
        assert not engine.retire_lora(new.lora_int_id)  # (not loaded any longer)
    finally:
        engine.shutdown()
