"""The engine seam: what the API asks of whatever produces tokens.

- ``base``: the :class:`Engine` contract, its request and event values, and the rules every
  engine shares (detokenising, stop strings, finish reasons, usage);
- ``options``: what a request asks (:class:`RequestOptions`) and what an engine honours
  (:class:`Capabilities`), one value each;
- ``modes``: the one table of which decoding modes combine;
- ``errors``: the engine's errors, each mapped to an HTTP status by the API;
- ``local``: the whole model on this device, in one process;
- ``draining``: an engine that finishes what it started and refuses new work while the
  daemon swaps or stops its model;
- ``drafting``: which drafter (lookup, Medusa heads, exit heads) a request gets.
"""
