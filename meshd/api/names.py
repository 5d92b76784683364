"""Which model names the API answers to, and what its replies call the model.

A home serves one model. A request that names another gets the client's own
"not found" — Ollama's 404 ``model "X" not found, try pulling it first``,
OpenAI's 404 with code ``model_not_found`` — never an answer from a model it
did not ask for (a client configured for ``llama3.2:3b`` would otherwise
believe it talks to Llama).

Known names: the served model's id (what ``/v1/models`` and ``/api/tags``
list), compared without case and without Ollama's default ``:latest`` tag;
``meshd``, which asks for whatever the home serves (so no other model can be
meant); and the names in the config's ``model_aliases`` (``"*"`` accepts any
name, for users who want leniency). An absent or empty name means the served
model too: meshd's own client sends none.

What replies call the model: OpenAI replies name the model actually served
(as OpenAI answers an alias with the model it resolved to). Ollama replies
echo the name asked for, which is the served model's own or an alias the user
configured: Ollama clients (Home Assistant's among them) match replies by the
name they asked for.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from meshd.api.validation import RequestError

ANY = "*"
GENERIC = "meshd"  # "the model this home serves", whichever it is


def name_key(name: str) -> str:
    """How names compare: no case, no surrounding space, ``:latest`` implied."""
    return name.strip().lower().removesuffix(":latest")


def tagged(name: str) -> str:
    """Ollama's spelling: a name without a tag is ``NAME:latest``."""
    return name if ":" in name else f"{name}:latest"


@dataclass(frozen=True)
class ModelNames:
    """The served model's names plus the configured aliases."""

    aliases: tuple[str, ...] = ()

    @classmethod
    def of(cls, aliases: Iterable[str] | None) -> ModelNames:
        return cls(tuple(a.strip() for a in (aliases or ()) if a and a.strip()))

    @property
    def any_name(self) -> bool:
        return ANY in self.aliases

    def listed(self, served: str) -> list[str]:
        """Names to list as models: the served one, then each explicit alias once."""
        out, seen = [served], {name_key(served)}
        for a in self.aliases:
            if a != ANY and name_key(a) not in seen:
                seen.add(name_key(a))
                out.append(a)
        return out

    def is_alias(self, served: str, asked: str | None) -> bool:
        """Whether ``asked`` reaches the served model only through an alias."""
        return not _names_served(served, asked) and (
            self.any_name or name_key(asked or "") in {name_key(a) for a in self.aliases})

    def known(self, served: str, asked: str | None) -> bool:
        return _names_served(served, asked) or self.is_alias(served, asked)

    def check(self, served: str, asked: str | None, *, ollama: bool) -> None:
        """Raise the dialect's 404 when ``asked`` is neither the served model nor an alias."""
        if not self.known(served, asked):
            raise not_found(asked or "", served, ollama=ollama)


def _names_served(served: str, asked: str | None) -> bool:
    """No name, the served model's own, or ``meshd``."""
    return not asked or not asked.strip() or name_key(asked) in (name_key(served), GENERIC)


def not_found(asked: str, served: str, *, ollama: bool) -> RequestError:
    """The 404 each client library recognises; the log line (and OpenAI's text) says what is served."""
    if ollama:  # Ollama's exact words: its clients and users know them
        quoted = '"' + asked.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return RequestError(f"model {quoted} not found, try pulling it first", status=404,
                            type="not_found_error", code="model_not_found")
    return RequestError(f"The model '{asked}' does not exist: this home serves '{served}' (the config's "
                        f"model_aliases can admit other names)", status=404, type="invalid_request_error",
                        param="model", code="model_not_found")
