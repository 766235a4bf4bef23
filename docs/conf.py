"""Sphinx configuration: ``nox -s docs`` builds it with warnings as errors."""

from __future__ import annotations

project = "lampdist"
author = "the lampdist developers"
extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = "lampdist"
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
myst_heading_anchors = 3
intersphinx_mapping: dict[str, tuple[str, None]] = {}
suppress_warnings = ["myst.xref_missing"]
nitpicky = False
