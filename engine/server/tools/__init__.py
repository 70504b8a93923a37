"""Tool calling on /v1/chat/completions: tools into the prompt, tool_choice into a constraint, and
the model's text back into OpenAI tool calls (whole, or as stream deltas)."""
