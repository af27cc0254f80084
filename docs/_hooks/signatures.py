"""A mkdocs hook: refuse to build the site when signatures would not be wrapped.

mkdocstrings formats each signature with Black or Ruff (`separate_signature`, `line_length`
in mkdocs.yml). Without either it only logs a message and prints every signature on one
line, which runs off the page. The `docs` extra installs Ruff; this makes its absence an
error instead of a silently worse site.
"""

import importlib.util
from typing import Any

from mkdocs.exceptions import PluginError


def on_config(config: Any) -> Any:
    if importlib.util.find_spec("black") is None and importlib.util.find_spec("ruff") is None:
        raise PluginError(
            "API signatures need Ruff or Black to be wrapped: "
            'pip install -e ".[docs]" (or pip install ruff)'
        )
    return config
