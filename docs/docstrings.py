"""A griffe extension that reads speedups' docstrings for the site as Python's own tools read them.

The docstrings are Google style with two habits from Sphinx that Markdown does not know:

- ``Example:`` (singular) heads the doctest examples; griffe takes only ``Examples:`` as code, and renders the
  singular as an admonition in which ``[4, 4, 2]`` reads as a Markdown link. It becomes ``Examples:``.
- A property made by a call (``step = _shown("step", "Micro-steps so far.")``, ``property(fget, doc=...)``)
  has its docstring in the call, where static analysis does not look: the string literal given as ``doc=``,
  or as the last argument of a private helper, becomes the attribute's docstring.
- Sphinx roles (``:func:`~speedups.tune_loader```) become a link to the API entry when they name a public
  object (``speedups.NAME`` with ``NAME`` in ``speedups.__all__``), else inline code.

Only what the site shows changes; the source stays as it is. mkdocs.yml loads this file by path.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|mod|data|exc|obj|const):`(~?)([^`]+)`")
_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.M)


def _public_names() -> set[str]:
    """``speedups.__all__``, read from the source (the site is built without importing torch)."""
    init = Path(__file__).resolve().parent.parent / "speedups" / "__init__.py"
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    return set()


PUBLIC = _public_names()


def tidy(text: str) -> str:
    """Return ``text`` with ``Example:`` as ``Examples:`` and Sphinx roles as Markdown."""

    def role(match: re.Match[str]) -> str:
        short, target = match.group(1) == "~", match.group(2).strip()
        shown = target.rsplit(".", 1)[-1] if short else target
        name = target.removeprefix("speedups.")
        if target.startswith("speedups.") and name in PUBLIC:
            return f"[`{shown}`][speedups.{name}]"
        return f"`{shown}`"

    return _ROLE.sub(role, _EXAMPLE.sub(r"\1Examples:", text))


def call_docstring(node: Any) -> str | None:
    """The docstring a property-making call carries (``doc=``, or a private helper's last argument)."""
    call = getattr(node, "value", None)
    if not isinstance(call, ast.Call):
        return None
    for keyword in call.keywords:
        if (
            keyword.arg == "doc"
            and isinstance(keyword.value, ast.Constant)
            and isinstance(keyword.value.value, str)
        ):
            return keyword.value.value
    private = isinstance(call.func, ast.Name) and call.func.id.startswith("_")
    last = call.args[-1] if call.args else None
    if private and isinstance(last, ast.Constant) and isinstance(last.value, str):
        return last.value
    return None


class TidyDocstrings(griffe.Extension):
    """Rewrite each docstring once, when griffe meets its object."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = tidy(obj.docstring.value)

    def on_attribute_instance(self, *, node: Any, attr: griffe.Attribute, **kwargs: Any) -> None:
        if attr.docstring is None and (doc := call_docstring(node)) is not None:
            attr.docstring = griffe.Docstring(tidy(doc), parent=attr)
            attr.labels.add("property")
