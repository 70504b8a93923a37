"""The engine core: the model, the KV cache, the scheduler and the block manager, stepping on token
ids (no text). It runs in-process under `LLM`/`LLMEngine`, and in its own process under
`kvpilot serve` (process.py in the child, client.py in the API process), with messages.py between
them."""
