"""Call sites as the report shows them (the text table, the HTML page, `flagos analyze`)."""
from __future__ import annotations

import os


def short_site(site: str | None) -> str:
    """Call sites for the table: relative to the working directory or to site-packages."""
    if not site:
        return "-"
    path, _, line = site.rpartition(":")
    marker = "site-packages" + os.sep
    if marker in path:
        path = path.split(marker, 1)[1]
    else:
        try:
            rel = os.path.relpath(path)
            path = rel if not rel.startswith("..") else path
        except ValueError:
            pass
    return f"{path}:{line}"
