"""OpenAIServing's runtime LoRA loads and unloads: on every engine or on none, also when an engine
does not answer (it is given up on after LORA_CALL_TIMEOUT_S, and the change is undone there too,
so the adapter lock is never held for good), and to their end when the client leaves."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import router.serving as serving_module
from engine_core.outputs import LoRARequest
from router.engine_client import EngineClient
from router.routing import RoundRobinPolicy
from router.serving import APIError, OpenAIServing, ServingSettings

from .tokenizer_factory import byte_level_tokenizer


class _Method:
    def __init__(self, engine: FakeEngine, name: str) -> None:
        self.engine, self.name = engine, name

    def remote(self, *args: Any) -> asyncio.Future:
        # (Shielded: as with Ray's object refs, a caller that stops waiting does not stop the call.)
        return asyncio.shield(getattr(self.engine, f"_{self.name}")(*args))


class FakeEngine:
    """An engine actor's LoRA calls, as an actor handle makes them (``method.remote(...)``); with
    ``hangs`` its loads and unloads take ``hangs`` seconds, after which they still take effect."""

    def __init__(self, hangs: float = 0.0) -> None:
        self.loras: dict[int, LoRARequest] = {}
        self.hangs = hangs

    def __getattr__(self, name: str) -> _Method:
        return _Method(self, name)

    async def _add_lora(self, lora: LoRARequest, replacing: int | None = None) -> bool:
        await asyncio.sleep(self.hangs)
        assert all(held.lora_name != lora.lora_name or i == replacing for i, held in self.loras.items())
        self.loras[lora.lora_int_id] = lora
        return True

    async def _retire_lora(self, lora_int_id: int) -> bool:  # (as if no request ran under it)
        return self.loras.pop(lora_int_id, None) is not None

    async def _list_loras(self) -> list[LoRARequest]:
        return list(self.loras.values())

    async def _remove_lora(self, lora_int_id: int) -> bool:
        await asyncio.sleep(self.hangs)
        return self.loras.pop(lora_int_id, None) is not None

    async def _lora_users(self, lora_int_id: int) -> int:
        return 0


def _serving(engines: list[FakeEngine]) -> OpenAIServing:
    return OpenAIServing(ServingSettings(served_model_name="tiny", max_model_len=256, allow_runtime_lora_updating=True),
                         EngineClient(engines, client_index=0), byte_level_tokenizer(), RoundRobinPolicy())


def test_an_engine_that_does_not_answer_a_load_fails_it_and_it_is_undone_everywhere(monkeypatch):
    monkeypatch.setattr(serving_module, "LORA_CALL_TIMEOUT_S", 0.05)
    answering, silent = FakeEngine(), FakeEngine(hangs=0.2)
    serving = _serving([answering, silent])

    async def main() -> None:
        with pytest.raises(APIError, match="Failed to load the lora adapter 'sql': engine 1 did not answer") as refused:
            await serving.load_lora_adapter("sql", "/adapters/sql")
        assert refused.value.status == 400
        await asyncio.sleep(0.5)  # (the silent engine's late load, then its undo)

    asyncio.run(main())
    assert answering.loras == {} and silent.loras == {} and "sql" not in serving.lora_adapters


def test_an_engine_that_does_not_answer_an_unload_fails_it_and_the_others_get_it_back(monkeypatch):
    answering, slow = FakeEngine(), FakeEngine()
    serving = _serving([answering, slow])

    async def main() -> LoRARequest:
        lora = await serving.load_lora_adapter("sql", "/adapters/sql")
        monkeypatch.setattr(serving_module, "LORA_CALL_TIMEOUT_S", 0.05)
        slow.hangs = 0.2
        with pytest.raises(APIError, match="Failed to unload the lora adapter 'sql': engine 1 did not answer"):
            await serving.unload_lora_adapter("sql")
        await asyncio.sleep(0.6)
        return lora

    lora = asyncio.run(main())
    assert answering.loras == slow.loras == {lora.lora_int_id: lora} and serving.lora_adapters == {"sql": lora}


def test_a_load_whose_client_leaves_is_made_on_every_engine():
    engines = [FakeEngine(hangs=0.05), FakeEngine(hangs=0.05)]
    serving = _serving(engines)

    async def main() -> None:
        from router.model_servings import ModelServings

        caller = asyncio.create_task(ModelServings([serving]).load_lora_adapter("sql", "/adapters/sql", None))
        await asyncio.sleep(0.07)  # (the first engine has it, the second not yet)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.sleep(0.2)

    asyncio.run(main())
    assert [list(e.loras) for e in engines] == [[serving.lora_adapters["sql"].lora_int_id]] * 2


def test_a_path_no_engine_finds_is_a_404_and_a_checkpoint_an_engine_refuses_a_400():
    """vLLM's statuses: "No adapter found" is a NotFoundError; any other refusal a BadRequestError."""

    class Refusing(FakeEngine):
        def __init__(self, error: Exception) -> None:
            super().__init__()
            self.error = error

        async def _add_lora(self, lora: LoRARequest, replacing: int | None = None) -> bool:
            raise self.error

    async def main() -> None:
        for error, status in ((FileNotFoundError("No adapter found at /nope"), 404),
                              (ValueError("LoRA adapter /a: rank 64 above --max-lora-rank 16"), 400)):
            serving = _serving([FakeEngine(), Refusing(error)])
            with pytest.raises(APIError) as refused:
                await serving.load_lora_adapter("sql", "/nope")
            assert refused.value.status == status and str(error) in str(refused.value)
            assert "sql" not in serving.lora_adapters

    asyncio.run(main())


def test_a_reload_in_place_replaces_the_adapter_on_every_engine_or_on_none():
    """load_inplace (vLLM's): the name gets a new load (a new id, so no KV of the earlier weights is
    reused) and each engine retires the earlier one; without it a loaded name is refused; a reload
    an engine refuses leaves the earlier load in place everywhere."""

    class RefusingLater(FakeEngine):
        refuse = False

        async def _add_lora(self, lora: LoRARequest, replacing: int | None = None) -> bool:
            if self.refuse:
                raise ValueError("LoRA adapter /bad: rank 64 above --max-lora-rank 16")
            return await super()._add_lora(lora, replacing)

    engines = [FakeEngine(), RefusingLater()]
    serving = _serving(engines)

    async def main() -> None:
        async def engines_adapters() -> list[LoRARequest]:
            return [lora for e in engines for lora in e.loras.values()]

        serving.list_loras = engines_adapters
        first = await serving.load_lora_adapter("sql", "/adapters/v1")
        with pytest.raises(APIError, match=r"already been loaded\. If you want to load the adapter in") as refused:
            await serving.load_lora_adapter("sql", "/adapters/v2")
        assert refused.value.status == 400 and refused.value.param == "lora_name"
        second = await serving.load_lora_adapter("sql", "/adapters/v2", load_inplace=True)
        assert second.lora_int_id != first.lora_int_id and second.lora_path == "/adapters/v2"
        assert [e.loras for e in engines] == [{second.lora_int_id: second}] * 2
        assert serving.lora_adapters == {"sql": second}
        engines[1].refuse = True
        with pytest.raises(APIError, match="Failed to load the lora adapter 'sql'"):
            await serving.load_lora_adapter("sql", "/bad", load_inplace=True)
        assert [e.loras for e in engines] == [{second.lora_int_id: second}] * 2
        assert serving.lora_adapters == {"sql": second}
        engines[1].refuse = False
        third = await serving.load_lora_adapter("new", "/adapters/new", load_inplace=True)  # (a new name: a load)
        assert serving.lora_adapters["new"] == third

    asyncio.run(main())
