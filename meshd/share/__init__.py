"""Model sharing over the LAN: a member that lacks the home's model gets it from members that have it.

    manifest.py  the digest manifest of a model file: regions (header, tensors, gaps), pieces, sha256s
    runs.py      sets of piece indices as run-lengths (what is on disk, what a peer holds)
    throttle.py  the token bucket behind ``--share-rate``
    store.py     the cache under the state dir: one sparse file per model digest + what is verified
    source.py    a model source over a partial file: loads a layer range, refuses tensors not fetched
    messages.py  the wire messages (adverts, targets, manifest and piece requests)
    fetch.py     fetching pieces from several holders at once, verified, resumable, rate-limited
    gate.py      the leader's rule: a plan waits until its members hold the layers it gives them
    deps.py      what the role needs from the daemon: settings, the transport, a few callbacks
    held.py      what this device holds: a local file or a cache entry, and its manifest
    endpoint.py  lending: the CURVE server answering manifest and piece requests
    peers.py     the others as lenders: their adverts, bans, links; the home's model
    own_fetch.py this device's fetch: the header, then exactly the pieces of its target range
    leader.py    the leader's side: targets for the members a new plan waits for
    service.py   the daemon's sharing role: builds the parts, orders start-up, adverts, status

Only GGUF files are shared (tensors at known offsets); a member running a
Hugging Face directory still serves its layers but cannot lend them.
"""
