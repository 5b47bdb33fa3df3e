"""mkdocs hooks: serve the committed results beside these pages, and write the methods tables.

`docs/results.md`, `docs/bench/*.md` and their plots are written by the experiments and
live outside this folder. They are added to the site at the paths they have under `docs/`,
so their own relative links, and links to them from these pages, resolve unchanged. Those
the nav does not list are reachable by link only (mkdocs' `not_in_nav`).

A page's `<!-- methods table -->` line becomes the table of `gradcomm.registry`, with a
column linking each method's page (`<!-- methods table: signatures -->` also gives each
factory's signature), so no page keeps a list of methods by hand. A registered method
whose page (`methods/<page>.md`) is not written yet gets one made from its module's
docstring and API, listed under Methods in the navigation.
"""

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel
from mkdocs.structure.nav import Navigation, Section
from mkdocs.structure.pages import Page

from gradcomm import registry

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
    for method in registry.METHODS.values():
        src = f"methods/{method.page}.md"
        if files.get_file_from_path(src) is None:
            module = method.factory.__module__
            content = f"# {method.title}\n\n::: {module}\n"
            files.append(File.generated(config, src, content=content))
    return files


def on_nav(nav: Navigation, config: MkDocsConfig, files: Files) -> Navigation:
    listed = {page.file.src_uri for page in nav.pages}
    (methods,) = [s for s in nav.items if isinstance(s, Section) and s.title == "Methods"]
    for method in registry.METHODS.values():
        file = files.get_file_from_path(f"methods/{method.page}.md")
        if file.src_uri not in listed:
            listed.add(file.src_uri)
            page = Page(method.title, file, config)
            page.parent = methods
            methods.children.append(page)
            nav.pages.append(page)
    return nav


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    depth = page.file.src_uri.count("/")  # links from a page in a subfolder go up first
    for marker, signatures in (("<!-- methods table -->", False),
                               ("<!-- methods table: signatures -->", True)):  # fmt: skip
        table = registry.markdown_table(links="../" * depth, signatures=signatures)
        markdown = markdown.replace(marker, table)
    return markdown
