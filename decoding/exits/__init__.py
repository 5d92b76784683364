"""Early exits (Synera), for every decoder family: a confident decode token leaves before the last layers.

- :mod:`.heads`: the trained exit heads and their file (``ExitHeads``), shared by training and serving;
- :mod:`.bound`: the heads bound to one stage, and the check a row passes to leave (``BoundExits``);
- :mod:`.owed`: the rows that left, and the layers they still owe the KV cache (``ExitedRows``).

A family's forward (``decoding.models``) only asks, after each exit layer, which
rows leave, and says how to run one of its layers over an owed row.
"""
