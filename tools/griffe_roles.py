"""Griffe extension for the documentation site (mkdocs.yml loads it).

probjax's docstrings name other objects with Sphinx roles (:func:`explain_dispatch`,
:class:`~probjax.masks.Mask`), which Markdown would print literally: each becomes a code span of
the name (the last component with ``~``). Only the rendered text changes, not the library.
"""

import re

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _plain(match: re.Match) -> str:
  tilde, name = match.groups()
  return f"`{name.rsplit('.', 1)[-1] if tilde else name}`"


class SphinxRoles(griffe.Extension):
  """Rewrites Sphinx cross-reference roles in docstrings as code spans."""

  def on_object(self, *, obj, **kwargs) -> None:
    if obj.docstring is not None:
      obj.docstring.value = _ROLE.sub(_plain, obj.docstring.value)
