"""`kvpilot serve`: the OpenAI-compatible HTTP server of one engine (see README.md here)."""
