"""Several models behind one endpoint: one ``OpenAIServing`` per served model (its own engines,
tokenizer, template, parsers and LoRA adapters), and the choice of the one a request's ``model``
names: a model's name, or the name of one of its adapters.

The first serving is the default: a request without ``model`` goes there, as a single-model
server answers it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from engine_core.outputs import LoRARequest
from router.detached import runs_to_completion
from router.request_timeline import current_timeline
from router.serving import APIError, OpenAIServing, bad_request, unknown_model


def count_under(serving: OpenAIServing) -> None:
    """The request being answered counts in the HTTP metrics under this serving's model."""
    timeline = current_timeline.get()
    if timeline is not None:
        timeline.metrics = serving.metrics


class ModelServings:
    def __init__(self, servings: list[OpenAIServing]) -> None:
        if not servings:
            raise ValueError("at least one served model is needed")
        self._by_name: dict[str, OpenAIServing] = {}
        for serving in servings:
            for name in serving.settings.served_names:  # (aliases too)
                if name in self._by_name:
                    raise ValueError(f"two served models are named {name!r}: give each a served_model_name of its "
                                     "own")
                self._by_name[name] = serving
        self.all = servings
        self.default = servings[0]
        # (One runtime load at a time: two of one name onto two models must not both pass the check.)
        self._loading = asyncio.Lock()

    def __iter__(self):
        return iter(self.all)

    @property
    def runtime_lora_updating(self) -> bool:
        return any(s.settings.allow_runtime_lora_updating for s in self.all)

    async def for_model(self, model: str | None) -> OpenAIServing:
        """The serving of the model (or of the model whose adapter) a request names; a 404 for a name
        no model or adapter has."""
        if model is None or len(self.all) == 1:
            return self.default  # (which refuses a name it does not know itself, adapters included)
        serving = self._by_name.get(model)
        if serving is None:
            serving = await self._adapter_owner(model)
        if serving is None:
            raise unknown_model(model)
        count_under(serving)
        return serving

    def named(self, model: Any) -> OpenAIServing | None:
        """The serving a model name (not an adapter's) is, without asking any engine; None if none."""
        return self._by_name.get(model) if isinstance(model, str) else None

    async def _adapter_owner(self, name: str) -> OpenAIServing | None:
        """The serving holding the adapter ``name``, asking the engines of those that do not know it
        (an adapter loaded through another replica)."""
        owner = next((s for s in self.all if name in s.lora_adapters), None)
        if owner is None:
            asking = [s for s in self.all if s.list_loras is not None]
            await asyncio.gather(*(s.refresh_loras() for s in asking))  # (each polls its own engines)
            owner = next((s for s in asking if name in s.lora_adapters), None)
        return owner

    @runs_to_completion
    async def load_lora_adapter(self, name: str, path: str, base_model_name: str | None,
                                load_inplace: bool = False) -> LoRARequest:
        """Load an adapter on the engines of ``base_model_name`` (by default the first model that
        takes runtime adapters). Its name must not be a model's or another adapter's of any model,
        unless ``load_inplace`` reloads that adapter (on its own model). Once begun it finishes (on
        every engine or on none) even if the client leaves."""
        if base_model_name is None:
            owner = next((s for s in self.all if s.settings.allow_runtime_lora_updating), self.default)
        else:
            owner = self._by_name.get(base_model_name)
            if owner is None:
                raise unknown_model(base_model_name)
        async with self._loading:
            holder = None if name in self._by_name else await self._adapter_owner(name)
            if name in self._by_name or (holder is not None and not load_inplace):
                raise bad_request(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                  "adapter in place, set 'load_inplace' to True.", "lora_name")
            if holder is not None:
                if base_model_name is not None and holder is not owner:
                    raise bad_request(f"The lora adapter '{name}' is loaded on the model "
                                      f"'{holder.settings.served_model_name}', not '{base_model_name}'.",
                                      "base_model_name")
                owner = holder
            if not owner.settings.allow_runtime_lora_updating:
                raise bad_request(f"The model '{owner.settings.served_model_name}' is not served with LoRA "
                                  "adapters (enable_lora).", "base_model_name")
            return await owner.load_lora_adapter(name, path, load_inplace)

    @runs_to_completion
    async def unload_lora_adapter(self, name: str) -> None:
        """Unload an adapter from its engines; once begun it finishes even if the client leaves."""
        owner = await self._adapter_owner(name)
        if owner is None or not owner.settings.allow_runtime_lora_updating:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError", "lora_name")
        await owner.unload_lora_adapter(name)
