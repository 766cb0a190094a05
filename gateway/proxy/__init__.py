"""The OpenAI-compatible surface: engine pool, relay and the /v1 routes."""
