"""Which speculative drafters this device can offer, and where their weights come from.

Medusa heads belong to one model: the shipped heads are used only with the
embedded model they were trained on (a configured heads file is checked
against the model's shapes). A draft model is loaded once per daemon, only
when configured, and lent to requests — each gets its own sequence in it.
"""

from __future__ import annotations

import threading
from pathlib import Path

from decoding.errors import DrafterError
from meshd.errors import MeshdError
from meshd.log import get_logger

log = get_logger("meshd.engine.drafting")


def medusa_heads_for(source, setting: str | None = None):
    """The Medusa heads to draft with for ``source`` (a configured file, or the shipped ones)."""
    from decoding.medusa import MedusaHeads
    from meshd.model import heads as shipped

    cfg = source.config
    if setting == "none":
        raise DrafterError("Medusa heads are turned off in this device's config")
    if setting:
        return MedusaHeads.load(setting, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size)
    return shipped.embedded_heads(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                  model_identity=getattr(source, "identity", None))


def medusa_factory(source, setting: str | None):
    """How the last stage gets Medusa heads: ``make(stage)`` -> MedusaSource, or DrafterError
    (the stage then reports why, and requests go on without them)."""

    def make(stage):
        from decoding.speculative.generate import MedusaSource

        if stage.lm_head is None:
            raise DrafterError("Medusa heads need the last stage (the LM head)")
        return MedusaSource(medusa_heads_for(source, setting), stage.lm_head)

    return make


def exit_heads_for(source, setting: str | None = None):
    """The early-exit heads for ``source`` (a configured file, or the ones shipped with the embedded model)."""
    from decoding.exits.heads import ExitHeads
    from meshd.model import heads as shipped

    cfg = source.config
    if setting == "none":
        raise DrafterError("early-exit heads are turned off in this device's config")
    if setting:
        return ExitHeads.load(setting, num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                              vocab_size=cfg.vocab_size)
    return shipped.embedded_exits(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                                  vocab_size=cfg.vocab_size, model_identity=getattr(source, "identity", None))


def exits_factory(source, setting: str | None):
    """How the last stage gets its early-exit heads: ``make(stage)`` -> ExitHeads, or DrafterError (the
    stage then says why in its status, and requests that ask for exits decode at full depth)."""
    return lambda stage: exit_heads_for(source, setting)


class DraftModels:
    """A draft model loaded once on this device, lent to requests (each gets its own sequence)."""

    def __init__(self, path: str, target):
        self.path, self.target = path, target
        self._pipe = None
        self._lock = threading.Lock()
        self._n = 0

    def __call__(self):
        from decoding.pipeline_local import LocalPipeline
        from decoding.speculative.draft_model import ModelDrafter, check_same_tokenizer
        from meshd.model.store import open_model

        # Errors reach the client as a 400: they name the draft model by its file name, never its
        # directory (the log has the whole path).
        name = Path(str(self.path)).name
        with self._lock:
            if self._pipe is None:
                try:
                    src = open_model(self.path)
                except (MeshdError, OSError) as exc:
                    log.warning("draft_model_unavailable", path=str(self.path), error=str(exc))
                    raise DrafterError(f"the draft model {name} configured on this device cannot be "
                                       f"opened; the daemon's log says why") from None
                check_same_tokenizer(self.target.tokenizer, src.tokenizer, draft_name=name)
                self._pipe = LocalPipeline.from_source(src, 1)
            self._n += 1
            return ModelDrafter(self._pipe, seq_id=f"draft-{self._n}", lock=self._lock)
