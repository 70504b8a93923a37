"""LoRA adapters in the engine: reading PEFT adapters, their weights in the device's slots, the
per-step mapping of tokens to slots, and the batched shrink/expand that adds every adapter's delta
to one batch in one pass per projection."""
