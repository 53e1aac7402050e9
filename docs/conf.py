"""Sphinx configuration of the ``ensembles`` documentation."""

import inspect
import sys

from flax import nnx
from sphinx.ext.autodoc.preserve_defaults import update_defvalue
from sphinx.pycode import ModuleAnalyzer
from sphinx.util.inspect import stringify_signature

import ensembles

project = "flax-ensembles"
author = "The ensembles developers"
copyright = "The ensembles developers"
release = ensembles.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# MyST: ::: fences, definition lists, and anchors for links to headings.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# Docstrings are Google style (ruff's pydocstyle "google" convention).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = True

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_default_options = {"members": None, "special-members": "__call__"}
autodoc_preserve_defaults = True

html_theme = "furo"
html_title = f"flax-ensembles {release}"


def _module_signature(app, what, name, obj, options, signature, return_annotation):
    """Shows the constructor arguments of NNX modules and variables.

    The metaclasses of ``nnx.Module`` and ``nnx.Variable`` define
    ``__call__(cls, *args, **kwargs)``, which autodoc would otherwise show as
    the signature of every layer. Bases without an ``__init__`` of their own
    show none.
    """
    if what != "class" or not isinstance(obj, type):
        return None
    if not issubclass(obj, nnx.Module | nnx.Variable):
        return None
    init = obj.__init__
    if init is object.__init__:
        return "", None
    update_defvalue(app, init, bound_method=True)
    parameters = list(inspect.signature(init).parameters.values())[1:]
    shown = inspect.Signature(parameters)
    return stringify_signature(shown, show_annotation=False), None


def _attribute_doc(module_name, attribute):
    """The ``#:`` doc comment of ``module_name.attribute``, or None."""
    try:
        docs = ModuleAnalyzer.for_module(module_name).find_attr_docs()
    except Exception:  # a module without source has no comments
        return None
    doc = docs.get(("", attribute))
    return list(doc) if doc else None


def _reexported_data_doc(app, what, name, obj, options, lines):
    """Documents a re-exported constant with the comment where it is defined.

    ``.. autodata:: ensembles.benchmark.METHODS`` reads ``#:`` comments from
    ``ensembles/benchmark/__init__.py`` only, which re-exports the constant,
    and would fall back to the docstring of ``tuple``; the comment lives in
    the submodule that defines it.
    """
    if what != "data":
        return
    module_name, _, attribute = name.rpartition(".")
    if _attribute_doc(module_name, attribute):
        return
    for other_name, module in list(sys.modules.items()):
        if not other_name.startswith(module_name + "."):
            continue
        if getattr(module, attribute, None) is not obj:
            continue
        doc = _attribute_doc(other_name, attribute)
        if doc:
            lines[:] = doc
            return


def setup(app):
    """Registers the autodoc hooks above."""
    app.connect("autodoc-process-signature", _module_signature)
    app.connect("autodoc-process-docstring", _reexported_data_doc)
