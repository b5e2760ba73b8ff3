"""Where relative paths in the run config point.

Flower runs the apps from an unpacked copy of the project (the FAB) that carries only source
and TOML files, in the working directory of the SuperLink. Relative paths such as the default
``models/miniature-ldm`` are therefore looked up in, in order: ``$FEDBIP_PROJECT_DIR``, the
source folder of an editable install of this project, and the current directory.
"""

from __future__ import annotations

import json
import os
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

DISTRIBUTION = "fedbip-flwr"


def project_dir() -> Path | None:
    """The checkout this project was installed from (``pip install -e .``), if any."""
    env = os.environ.get("FEDBIP_PROJECT_DIR")
    if env:
        return Path(env)
    try:
        direct_url = metadata.distribution(DISTRIBUTION).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    if not direct_url:
        return None
    url = json.loads(direct_url).get("url", "")
    return Path(unquote(urlparse(url).path)) if url.startswith("file://") else None


def resolve(path: str | Path) -> Path:
    """Absolute paths stay; relative ones resolve against the bases above (first that exists)."""
    path = Path(path).expanduser()
    if path.is_absolute():
        return path
    bases = [b for b in (project_dir(), Path.cwd()) if b is not None]
    for base in bases:
        if (base / path).exists():
            return base / path
    return bases[0] / path
