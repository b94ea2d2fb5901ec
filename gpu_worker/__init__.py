"""Model execution for the engine: models, paged KV cache, model runner, sampler and TP workers."""
