"""The OpenAI surface that both the gateway and the engine's own OpenAI server expose.

``requests``: request schemas and their conversion to the RPC; ``responses``: RPC frames to SSE
chunks or one response object; ``errors``: OpenAI's error body. Both servers use these modules so
their surfaces cannot drift.
"""
