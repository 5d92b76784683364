"""Ollama's model endpoints: what the home serves, described as Ollama describes a model.

``/api/tags``, ``/api/ps`` and ``/api/show`` list and describe the served
model (and each alias, as Ollama lists a copy: same digest); ``/api/pull``
of a name the home serves succeeds at once and of any other says why it
cannot be pulled here; ``/api/version`` and ``GET /`` answer Ollama clients'
"is a server running here?". The endpoints that manage models on one
machine are a 501: a home's model is managed with ``meshd model``.
"""

from __future__ import annotations

import contextlib
from datetime import datetime, timezone
from typing import Any

from aiohttp import web

from meshd.api.common import ENGINE, MODEL_INFO, NAMES, await_engine, log, read_json, served_model
from meshd.api.names import name_key
from meshd.api.names import tagged as _tagged
from meshd.api.ollama_replies import ndjson, now
from meshd.api.ollama_schema import DEFAULTS, NameBody
from meshd.api.validation import RequestError, validate
from meshd.engine.base import Engine

OLLAMA_API_VERSION = "0.12.0"  # the Ollama API release whose endpoints and fields we mirror


def _source(engine: Engine):
    return getattr(engine, "source", None)


def _details(engine: Engine) -> dict[str, Any]:
    src = _source(engine)
    cfg = getattr(src, "config", None)
    arch = getattr(cfg, "arch", None) or "unknown"
    return {"parent_model": "", "format": "gguf" if str(getattr(src, "path", "")).endswith(".gguf") else "",
            "family": arch, "families": [arch], "parameter_size": _param_size(cfg),
            "quantization_level": _quant(src)}


def _param_count(cfg) -> int | None:
    if cfg is None:
        return None
    h, i, n, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    kv = cfg.num_kv_heads * cfg.head_dim
    per_layer = h * (cfg.num_heads * cfg.head_dim) * 2 + h * kv * 2 + 3 * h * i + 2 * h
    return n * per_layer + v * h * (1 if cfg.tie_embeddings else 2) + h


def _param_size(cfg) -> str:
    n = _param_count(cfg)
    if not n:
        return ""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def _quant(src) -> str:
    try:
        import gguf

        return gguf.LlamaFileType(src.file_type).name.removeprefix("MOSTLY_")
    except Exception:  # noqa: BLE001 - metadata only: unknown is an honest answer
        return ""


def _file_info(request: web.Request, engine: Engine) -> dict[str, Any]:
    """size, digest, modified_at of the served model file (from the daemon, or the engine's source)."""
    provider = request.app[MODEL_INFO]
    if provider is not None:
        return dict(provider())
    src = _source(engine)
    path = getattr(src, "path", None)
    info: dict[str, Any] = {"size": 0, "digest": "", "modified_at": now()}
    with contextlib.suppress(OSError, TypeError, AttributeError):
        st = path.stat()
        info["size"] = st.st_size
        info["modified_at"] = datetime.fromtimestamp(st.st_mtime, timezone.utc).isoformat()
    ident = str(getattr(src, "identity", "") or "")
    info["digest"] = ident.rpartition("@")[2]
    return info


def _model_entry(request: web.Request, engine: Engine, name: str | None = None) -> dict[str, Any]:
    f = _file_info(request, engine)
    name = _tagged(name or engine.model_id)
    return {"name": name, "model": name, "modified_at": f["modified_at"], "size": f["size"],
            "digest": f["digest"], "details": _details(engine)}


def _capabilities(engine: Engine) -> list[str]:
    caps = ["completion"]
    if getattr(engine.tokenizer, "supports_tools", False):
        caps.append("tools")
    if getattr(engine.tokenizer, "supports_thinking", False):
        caps.append("thinking")  # Ollama's word: clients offer 'think' only where it is listed
    return caps


async def root(request: web.Request) -> web.Response:
    return web.Response(text="Ollama is running (meshd)")


async def version(request: web.Request) -> web.Response:
    from meshd import __version__

    return web.json_response({"version": OLLAMA_API_VERSION, "meshd": __version__})


async def tags(request: web.Request) -> web.Response:
    """The served model, then each configured alias (as Ollama lists a copy: same digest).

    Home Assistant looks its configured model up here and pulls it when absent.
    """
    engine = request.app[ENGINE]
    names = request.app[NAMES].listed(engine.model_id) if engine else []
    return web.json_response({"models": [_model_entry(request, engine, n) for n in names]})


async def ps(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if engine is None:
        return web.json_response({"models": []})
    entry = _model_entry(request, engine)
    entry.update({"expires_at": "2318-01-01T00:00:00Z",  # loaded while the daemon runs
                  "size_vram": 0, "context_length": engine.context_length})
    return web.json_response({"models": [entry]})


async def show(request: web.Request) -> web.Response:
    body = validate(NameBody, await read_json(request))
    engine = await await_engine(request)
    served_model(request, engine, body.target, ollama=True)
    src = _source(engine)
    cfg = getattr(src, "config", None)
    arch = getattr(cfg, "arch", "unknown")
    info: dict[str, Any] = {"general.architecture": arch,
                            "general.parameter_count": _param_count(cfg) or 0,
                            f"{arch}.context_length": engine.context_length}
    if cfg is not None:
        info.update({f"{arch}.embedding_length": cfg.hidden_size, f"{arch}.block_count": cfg.num_layers,
                     f"{arch}.attention.head_count": cfg.num_heads,
                     f"{arch}.attention.head_count_kv": cfg.num_kv_heads,
                     f"{arch}.vocab_size": cfg.vocab_size})
    template = getattr(getattr(engine.tokenizer, "meta", None), "chat_template", None) or ""
    params = "\n".join(f"{k:<15} {v}" for k, v in DEFAULTS.items())
    f = _file_info(request, engine)
    # FROM names the model, not its file: where the daemon keeps it is not for clients.
    return web.json_response({
        "license": "", "modelfile": f"# served by meshd as {body.target or engine.model_id}\n"
                                    f"FROM {engine.model_id}\n",
        "parameters": params, "template": template, "details": _details(engine),
        "model_info": info, "capabilities": _capabilities(engine), "modified_at": f["modified_at"],
    })


async def not_implemented(request: web.Request) -> web.Response:
    raise RequestError(f"{request.path} is not implemented by meshd (it serves one chat model "
                       f"for the home; models are managed with 'meshd model')", status=501,
                       code="not_implemented")


# --------------------------------------------------------------------------- pull


async def pull(request: web.Request) -> web.StreamResponse:
    """Success for a name the home serves (it is there); Ollama's pull error for any other.

    Nothing is downloaded: a home serves one model, held by every member, so
    fetching another onto this device would change nothing a client can use
    and would report a success that ``/api/chat`` then contradicts. A catalog
    model gets the commands that do switch the home; any other name, Ollama's
    own "file does not exist". Errors take Ollama's two forms: streamed, a
    ``{"error": ...}`` line in a 200 NDJSON reply; not streamed, a 500 with
    the same object (the status Ollama answers a failed pull with).
    """
    from meshd.model import store as model_store

    body = validate(NameBody, await read_json(request))
    engine = await await_engine(request)
    served, names = engine.model_id, request.app[NAMES]
    if body.target.strip() and names.known(served, body.target):
        if body.stream:
            return await ndjson(request, [{"status": "success"}])
        return web.json_response({"status": "success"})
    name, wanted = body.target.strip(), name_key(body.target)
    if wanted in model_store.CATALOG:
        message = (f"{wanted} is not the model this home serves ({served}), and a pull through the API "
                   f"cannot change that: every member holds the home's one model. To serve {wanted}, run "
                   f"'meshd model pull {wanted}' on each member and restart them with --model {wanted}")
    else:
        listed = ", ".join(names.listed(served))
        message = (f"pull model manifest: file does not exist: meshd cannot fetch {name!r}; this home "
                   f"serves {listed} (the config's model_aliases can admit other names)")
    log.warning("ollama_pull_refused", model=name, served=served)
    if body.stream:
        return await ndjson(request, [{"error": message}])
    return web.json_response({"error": message}, status=500)

