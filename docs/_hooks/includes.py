"""A mkdocs hook: a repository file outside `docs/` shown as (part of) a page.

A line `--8<-- "bench/README.md"` in a page is replaced by that file, read from the
repository root (a missing file fails the build). The file's links into the documentation,
written for the repository (`../docs/guides/...`), are rewritten relative to `docs/` for a
page at the top of `docs/`, so `mkdocs build --strict` checks them like any other link.
"""

import pathlib
import re
from typing import Any

from mkdocs.exceptions import PluginError


_INCLUDE = re.compile(r'^--8<-- "(?P<path>[^"]+)"[ \t]*$', flags=re.M)


def on_page_markdown(markdown: str, page: Any, config: Any, **kwargs: Any) -> str:
    root = pathlib.Path(config.config_file_path).parent

    def include(match: re.Match[str]) -> str:
        if "/" in page.file.src_uri:
            raise PluginError(f"{page.file.src_uri}: include files only in top-level pages")
        path = root / match["path"]
        if not path.is_file():
            raise PluginError(f"{page.file.src_uri}: no file {match['path']} to include")
        return path.read_text().replace("](../docs/", "](")

    return _INCLUDE.sub(include, markdown)
