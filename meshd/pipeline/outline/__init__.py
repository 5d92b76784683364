"""Outline decoding: answers that are a list of points, written as an outline and expanded in parallel.

- :mod:`.decoder` — ``OutlineDecoder``: writes the outline, then every point at once, forked from it
- :mod:`.gate` — whether a request is answered in outline mode, decided before any token is generated
- :mod:`.router` — the small shipped classifier ``outline: "auto"`` asks (and its training: ``python -m``)
"""
