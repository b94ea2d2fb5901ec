"""Engine core: requests, the vLLM-v1-style scheduler, the prefix-caching KV cache manager and the
EngineCore step loop. Scheduling and KV code is pure Python over ints and block ids (no torch)."""
