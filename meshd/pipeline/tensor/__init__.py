"""A stage held by a tensor-parallel group: every member computes its share of every layer of the range.

    first member (leads) ──cache operations, each pass's rows──► other members
          │  forward on its share                                │  forward on their shares
          └──── partial sums, twice a layer, all to all (transport.group_link) ────┘

The first member owns the sequences (the cache operations and the rows a pass runs); the others mirror
them from its commands, so every member's KV cache holds the same positions of its own heads.
"""
