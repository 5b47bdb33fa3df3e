"""Griffe extension: read gradcomm's "Example:" sections as Google-style examples.

gradcomm's docstrings title their doctests "Example:" (as Napoleon reads them); griffe's
Google parser knows only "Examples:" and would render the doctest as quoted prose. This
renames the title before parsing, so the `>>>` blocks render as code.
"""

import re
from typing import Any

import griffe

_TITLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _TITLE.sub(r"\1Examples:", obj.docstring.value)
