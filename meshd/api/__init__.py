"""The client API: OpenAI-compatible HTTP/1.1 on a unix socket (aiohttp)."""
