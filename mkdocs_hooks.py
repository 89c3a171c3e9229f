"""mkdocs hooks (mkdocs.yml `hooks:`): the navigation is found from docs/ without a `nav:`
list, and mkdocs titles a directory's section by its name; these give sections the titles
their names cannot."""

from typing import Any

SECTION_TITLES = {"Api": "API reference"}


def on_nav(nav: Any, **_: Any) -> Any:
    for item in nav.items:
        if item.is_section and item.title in SECTION_TITLES:
            item.title = SECTION_TITLES[item.title]
    return nav
