"""mkdocs hook: serve the committed results beside these pages.

`docs/results.md`, `docs/bench/*.md` and their plots are written by the experiments and
live outside this folder. They are added to the site at the paths they have under `docs/`,
so their own relative links, and links to them from these pages, resolve unchanged. Those
the nav does not list are reachable by link only (mkdocs' `not_in_nav`).
"""

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel

DOCS = Path(__file__).resolve().parent.parent  # docs/
SITE_SOURCE = Path(__file__).resolve().parent  # docs/site/


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for pattern in ("**/*.md", "**/*.png"):
        for path in sorted(DOCS.glob(pattern)):
            if SITE_SOURCE in path.parents:
                continue
            src = path.relative_to(DOCS).as_posix()
            if files.get_file_from_path(src) is None:
                file = File(src, str(DOCS), config["site_dir"], config["use_directory_urls"])
                file.inclusion = InclusionLevel.NOT_IN_NAV
                files.append(file)
    return files
