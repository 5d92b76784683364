"""meshd: one LLM served together by the idle devices of a home."""

__version__ = "0.2.0"
