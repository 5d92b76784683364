"""meshd: one LLM served together by the idle devices of a home."""

__version__ = "0.1.0"
