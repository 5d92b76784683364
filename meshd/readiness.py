"""Why a daemon that holds a model does not serve yet, read from its status document.

One wording for ``GET /health``'s 503 and ``meshd status --wait --ready``'s timeout: both
answer a person asking "why not yet?", and a device that holds another model than the
home's must not look as if it were still loading (it never warms up).
"""

from __future__ import annotations

from typing import Any


def not_ready_reason(status: dict[str, Any]) -> str:
    plan = status.get("plan")
    if not isinstance(plan, dict):
        return "waiting for a plan" if not plan else "planning"
    home_model, mine = plan.get("model"), status.get("model_identity")
    if home_model and mine and home_model != mine:
        from meshd.model.store import model_flag_for

        return (f"this device holds {mine.partition('@')[0]}, the home serves {home_model.partition('@')[0]}: "
                f"restart it {model_flag_for(home_model)}")
    return f"plan v{plan.get('version')} is loading its stages"
