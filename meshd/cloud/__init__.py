"""The cloud peer: a verifier many homes share (``verifier``, ``service``), how a home pairs
with it (``pairing``), and the home's side of the link (``link``, ``engine``)."""
