"""Several models behind one endpoint: one ``OpenAIServing`` per served model (its own engines,
tokenizer, template and parsers), and the choice of the one a request's ``model`` names.

The first serving is the default: a request without ``model`` goes there, as a single-model
server answers it, and only it serves LoRA adapters and the runtime adapter endpoints.
"""

from __future__ import annotations

from router.serving import OpenAIServing, unknown_model


class ModelServings:
    def __init__(self, servings: list[OpenAIServing]) -> None:
        if not servings:
            raise ValueError("at least one served model is needed")
        names = [s.settings.served_model_name for s in servings]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"two served models are named {name!r}: give each a served_model_name of its own")
        self.all = servings
        self.default = servings[0]
        self._by_name = dict(zip(names, servings, strict=True))

    def __iter__(self):
        return iter(self.all)

    async def for_model(self, model: str | None) -> OpenAIServing:
        """The serving of the model (or of the first model's adapter) a request names; a 404 for
        a name no model or adapter has."""
        if model is None or len(self.all) == 1:
            return self.default  # (which refuses a name it does not know itself, adapters included)
        serving = self._by_name.get(model)
        if serving is not None:
            return serving
        if model not in self.default.lora_adapters:
            await self.default.refresh_loras()  # (an adapter loaded through another replica)
            if model not in self.default.lora_adapters:
                raise unknown_model(model)
        return self.default
