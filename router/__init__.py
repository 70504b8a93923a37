"""`kvpilot router`: one OpenAI-compatible endpoint for every InferenceService, routing each
request to the replica that holds the longest run of its prompt's KV blocks (known exactly, from
the engines' block events), within a bounded load, and holding requests for a model at zero
replicas while it wakes. Imports no torch and no kopf."""
