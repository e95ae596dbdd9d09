"""MkDocs hook: links from a page to files of the repository outside docs/ (a benchmark's result
file, an example config, a chart), written as relative paths so that they also work when the
Markdown is read in the repository (`[result](../bench/results/h200-abfc79b/zero3_8b/scale_bench.md)`,
`![chart](../bench/results/.../train_bench.png)`).

MkDocs only knows the files under docs/ and would report such a link as broken. This hook
checks that the file exists (a missing one is a warning, so `mkdocs build --strict` fails) and
copies it into the site under `repository/`, so that the link and the image work in the built
site too. Links inside code blocks are left alone."""

from __future__ import annotations

import logging
import os
import posixpath
import re
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.plugins.repo_files")

SITE_FOLDER = "repository"
"""Where the linked files land in the built site."""
_SCHEME = "repo-file:"
"""Stands for a repository file between the Markdown and the HTML stage (MkDocs leaves a link
with a scheme alone)."""
_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
_FENCE = re.compile(r"^\s*(```|~~~)")

_linked: set[str] = set()


def on_pre_build(config: Any) -> None:
    _linked.clear()


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    root = Path(config.config_file_path).parent.resolve()
    docs = Path(config.docs_dir).resolve()
    source = Path(page.file.abs_src_path).parent
    lines, fenced = [], False
    for line in markdown.split("\n"):
        if _FENCE.match(line):
            fenced = not fenced
        if not fenced:
            line = _LINK.sub(lambda m: _rewrite(m, source, docs, root, page), line)
        lines.append(line)
    return "\n".join(lines)


def _rewrite(match: re.Match[str], source: Path, docs: Path, root: Path, page: Any) -> str:
    target = match.group(2)
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return match.group(0)
    path, _, anchor = target.partition("#")
    resolved = (source / path).resolve()
    if resolved.is_relative_to(docs) or not resolved.is_relative_to(root):
        return match.group(0)  # a page of the site (MkDocs checks it), or outside the repository
    relative = resolved.relative_to(root).as_posix()
    if not resolved.is_file():
        log.warning(f"Doc file '{page.file.src_uri}' links to '{target}', not in the repository")
        return match.group(0)
    _linked.add(relative)
    return f"{match.group(1)}{_SCHEME}{relative}{'#' + anchor if anchor else ''}{match.group(3)}"


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    # The folder the page is served from: reference/api/ (or reference/ for reference/api.html).
    here = page.url.rstrip("/") if config.use_directory_urls else posixpath.dirname(page.url)

    def url(match: re.Match[str]) -> str:
        target = posixpath.join(SITE_FOLDER, match.group(2))
        return f'{match.group(1)}="{posixpath.relpath(target, here or ".")}'

    return re.sub(rf'(href|src)="{re.escape(_SCHEME)}([^"#]*)', url, html)


def on_post_build(config: Any) -> None:
    root = Path(config.config_file_path).parent
    for relative in sorted(_linked):
        destination = Path(config.site_dir) / SITE_FOLDER / relative
        os.makedirs(destination.parent, exist_ok=True)
        shutil.copyfile(root / relative, destination)
