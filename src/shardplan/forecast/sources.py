"""Where a forecast's inputs come from: a preset name, or a JSON file (one loader for networks and
compute models alike)."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

from ..errors import ForecastError


def preset_or_file(text: str, presets: Mapping[str, Any], key: str, what: str, hint: str = "") -> Optional[Any]:
    """``presets[text]``; else the JSON file ``text`` (its ``key`` entry when it has one) as a dict or list;
    else ``None`` (the caller names the choices).

    >>> preset_or_file("h100-8x-ib400", {"h100-8x-ib400": 1}, "network", "network")
    1
    """
    if text in presets:
        return presets[text]
    if not os.path.exists(text):
        return None
    try:
        with open(text) as f:
            d = json.load(f)
    except (OSError, ValueError) as exc:
        raise ForecastError(f"{what} file {text}: not readable JSON ({exc}){hint}") from None
    return d.get(key, d) if isinstance(d, Mapping) else d
