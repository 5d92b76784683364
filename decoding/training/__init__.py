"""Training code (Medusa heads): run by ``meshd heads train``, never imported by the runtime.

The daemon and the stages import ``decoding`` to serve; nothing they import
reaches this package (a test checks it), so training's dependencies and
memory stay out of a serving process.
"""
