"""What a router replica takes from its flags and from the engines' descriptions (serving_settings)."""

from __future__ import annotations

from engine_core.engine_actor import EngineDescription
from engine_core.executor import ModelInfo
from router.deployment import RouterConfig, serving_settings


def _description(index: int, max_model_len: int = 256, policy: str = "fcfs", sleep: bool = True,
                 defaults: dict | None = None) -> EngineDescription:
    info = ModelInfo(served_model_name="/models/qwen", model_dir="/models/qwen", max_model_len=max_model_len,
                     vocab_size=100, eos_token_ids=(2, 7), hidden_size=64, default_sampling_params=defaults or {},
                     max_logprobs=50)
    return EngineDescription(model_info=info, scheduler_config={"max_model_len": max_model_len, "policy": policy},
                             block_size=32, num_blocks=10, engine_index=index, enable_sleep_mode=sleep)


def test_the_models_facts_come_from_the_engines_and_the_names_from_the_flags():
    defaults = {"temperature": 0.7, "top_k": 20, "max_tokens": 512}
    engines = [_description(0, 256, defaults=defaults), _description(1, 128, defaults=defaults)]
    config = RouterConfig(engine_actor_names=["e0", "e1"], namespace="ns", served_model_name="qwen",
                          served_model_aliases=("qwen-latest",), model="/models/Qwen3", stream_interval=3,
                          response_role="bot", chat_template_content_format="openai")
    settings = serving_settings(config, engines)
    assert (settings.response_role, settings.chat_template_content_format) == ("bot", "openai")
    assert (settings.served_model_name, settings.served_names) == ("qwen", ("qwen", "qwen-latest"))
    assert settings.model_root == "/models/Qwen3"  # (the model as given: /v1/models' root)
    assert (settings.max_logprobs, settings.vocab_size) == (50, 100)  # (--max-logprobs, as the engines resolved it)
    assert settings.default_sampling_params == defaults  # (the generation config the engines read)
    assert (settings.max_model_len, settings.block_size, settings.eos_token_ids, settings.hidden_size) == (
        128, 32, (2, 7), 64)
    assert (settings.scheduling_policy, settings.enable_sleep_mode, settings.stream_interval) == ("fcfs", True, 3)
    # No name given: the model's own; engines that disagree on the policy (or on sleep) get the common ground.
    mixed = [_description(0, policy="priority"), _description(1, sleep=False)]
    plain = serving_settings(RouterConfig(engine_actor_names=["e0", "e1"], namespace="ns"), mixed)
    assert (plain.served_names, plain.default_sampling_params) == (("/models/qwen",), {})
    assert plain.model_root == "/models/qwen"  # (the engines' model directory)
    assert (plain.scheduling_policy, plain.enable_sleep_mode) == ("fcfs", False)
    assert serving_settings(RouterConfig(engine_actor_names=["e0"], namespace="ns"),
                            [_description(0, policy="priority")]).scheduling_policy == "priority"


def test_a_scrape_leaves_out_an_engine_that_fails_or_does_not_answer_in_time(monkeypatch):
    """/metrics asks every engine at once, and one that hangs (a dying node) or fails is left out of
    that scrape instead of making it miss Prometheus's timeout with every series."""
    import asyncio

    import router.deployment as deployment
    from router.engine_client import EngineClient

    monkeypatch.setattr(deployment, "METRICS_CALL_TIMEOUT_S", 0.2)
    events: list[str] = []
    calls: list[asyncio.Future] = []

    class Engine:
        def __init__(self, name: str, hangs: bool = False, fails: bool = False) -> None:
            self.name, self.hangs, self.fails = name, hangs, fails

        @property
        def get_metrics_text(self):
            engine = self

            class Method:
                @staticmethod
                def remote():
                    async def call():
                        events.append(f"asked {engine.name}")
                        await asyncio.sleep(3600 if engine.hangs else 0.01)
                        events.append(f"answered {engine.name}")
                        if engine.fails:
                            raise RuntimeError("engine died")
                        return f"{engine.name} 1\n".encode()
                    calls.append(asyncio.ensure_future(call()))
                    return calls[-1]
            return Method

    client = EngineClient([Engine("a"), Engine("b", hangs=True), Engine("c", fails=True), Engine("d")],
                          client_index=0)
    texts = asyncio.run(deployment.engine_metrics_texts(client))
    assert texts == [b"a 1\n", b"d 1\n"]
    assert events[:4] == ["asked a", "asked b", "asked c", "asked d"]  # (all at once, not one after another)
    assert calls[1].cancelled()  # (given up on, not waited for)
