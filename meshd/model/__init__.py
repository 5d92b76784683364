"""The model files a device holds and what it learns about them.

- ``store``: the model cache (names, pulls, checksums); ``hub_models``/``hub_pull``/``catalog``:
  models from the Hub and the list the CLI offers; ``advice``/``fit``: which model fits this home;
- ``profile_files``/``self_profile``: this device's measured profile, read and written;
- ``profiler``: measures this device running the model (``meshd profile``, and the self-profile's
  one-layer timing);
- ``heads``: the shipped Medusa and exit heads, pinned by checksum;
- ``host``: loads the model this device serves and swaps it when the plan changes.
"""
