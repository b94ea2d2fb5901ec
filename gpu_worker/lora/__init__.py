"""Multi-LoRA serving on the workers: PEFT checkpoints, their per-rank shards, and the layers that apply them."""
