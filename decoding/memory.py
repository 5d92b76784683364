"""Give the operating system back the heap a stage no longer uses.

Loading a stage reads, widens and repacks tensors a few at a time; glibc keeps
the freed temporaries in its arenas, so the process would stay that much larger
than its weights for its whole life (several times the weights of a packed
stage). ``malloc_trim`` returns them. Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_libc = None


def release_free_memory() -> bool:
    """Return freed heap to the OS (glibc); True when it was attempted."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
        except OSError:
            _libc = False
    trim = getattr(_libc, "malloc_trim", None) if _libc else None
    if trim is None:
        return False
    trim(0)
    return True


def freeze_long_lived() -> None:
    """Leave the objects alive now (imported modules, a loaded stage's tensors and layers) out of
    every later garbage collection.

    A decode step allocates a few hundred short-lived Python objects, so the cyclic collector runs
    every few steps — and each of its older-generation passes walks the whole heap of torch,
    transformers and the model: ~7 % of the embedded model's decode step at one core. Frozen
    objects are still freed by reference counting; call this again after the next load: it thaws
    what the previous call froze and collects once first, so a replaced stage's cycles (and the
    load's own cyclic garbage) are not kept for good. That collection holds the GIL for a few
    hundred milliseconds, once a load.
    """
    import gc

    gc.unfreeze()
    gc.collect()
    gc.freeze()
