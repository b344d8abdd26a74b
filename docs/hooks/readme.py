"""An mkdocs hook: the repository's README as the site's home page and its CHANGELOG as a page,
their links made site links."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

# The root's pages, and the site pages they become.
_ROOT_PAGES = {"README.md": "index.md", "CHANGELOG.md": "changelog.md"}
# The root's pages link docs/x.md and each other from the root; on the site all pages lie side
# by side. A link to a module's source (mmcache/format.py, ../mmcache/format.py) goes to its API
# reference instead, since the site does not carry the sources.
_DOCS_LINK = re.compile(r"\]\(docs/")
_ROOT_LINK = re.compile(r"\]\((README|CHANGELOG)\.md")
_SOURCE_LINK = re.compile(r"\]\((?:\.\./)?mmcache/(\w+)\.py\)")


def on_files(files: Files, config) -> Files:
    root = Path(config["config_file_path"]).parent
    for name, page in _ROOT_PAGES.items():
        content = (root / name).read_text(encoding="utf-8")
        files.append(File.generated(config, page, content=content))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri in _ROOT_PAGES.values():
        markdown = _DOCS_LINK.sub("](", markdown)
        markdown = _ROOT_LINK.sub(lambda m: f"]({_ROOT_PAGES[m[1] + '.md']}", markdown)
    return _SOURCE_LINK.sub(r"](api.md#mmcache.\1)", markdown)
