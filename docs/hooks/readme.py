"""An mkdocs hook: the repository's README as the site's home page, its links made site links."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

# README links docs/x.md from the root; on the site both pages lie side by side. A link to a
# module's source (mmcache/format.py, ../mmcache/format.py) goes to its API reference instead,
# since the site does not carry the sources.
_DOCS_LINK = re.compile(r"\]\(docs/")
_SOURCE_LINK = re.compile(r"\]\((?:\.\./)?mmcache/(\w+)\.py\)")


def on_files(files: Files, config) -> Files:
    readme = Path(config["config_file_path"]).parent / "README.md"
    files.append(File.generated(config, "index.md", content=readme.read_text(encoding="utf-8")))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == "index.md":
        markdown = _DOCS_LINK.sub("](", markdown)
    return _SOURCE_LINK.sub(r"](api.md#mmcache.\1)", markdown)
