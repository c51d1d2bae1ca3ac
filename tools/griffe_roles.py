"""Griffe extension for the documentation site (mkdocs.yml loads it).

probjax's docstrings are written for Sphinx-style readers and doctest, and Markdown would
misread two of their habits; only the rendered text changes, not the library:

* Sphinx roles (:func:`explain_dispatch`, :class:`~probjax.masks.Mask`) would print literally:
  each becomes a code span of the name (the last component with ``~``).
* Doctest examples (``>>>`` lines and the output under them) would render as nested block
  quotes: each run of them becomes a fenced ``pycon`` code block, ending at a blank line, as
  doctest ends an example's expected output.
"""

import re

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _plain(match: re.Match) -> str:
  tilde, name = match.groups()
  return f"`{name.rsplit('.', 1)[-1] if tilde else name}`"


def fence_doctests(text: str) -> str:
  """``text`` with each doctest block (a ``>>>`` line up to the next blank line, at its first
  line's indentation) wrapped in a fenced ``pycon`` code block; text already inside a fence is
  left alone."""
  out: list[str] = []
  lines = text.split("\n")
  i, in_fence = 0, False
  while i < len(lines):
    line = lines[i]
    stripped = line.lstrip()
    if stripped.startswith("```"):
      in_fence = not in_fence
    if in_fence or not stripped.startswith(">>>"):
      out.append(line)
      i += 1
      continue
    indent = line[: len(line) - len(stripped)]
    block = []
    while i < len(lines) and lines[i].strip():
      block.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
      i += 1
    out += [f"{indent}```pycon"] + [indent + b for b in block] + [f"{indent}```"]
  return "\n".join(out)


class SphinxRoles(griffe.Extension):
  """Rewrites Sphinx cross-reference roles as code spans and doctest examples as code blocks."""

  def on_instance(self, *, obj, **kwargs) -> None:
    # Every object as it is created (packages included, which on_object does not reach for a
    # module whose names load lazily); both rewrites leave rewritten text unchanged.
    if obj.docstring is not None:
      obj.docstring.value = fence_doctests(_ROLE.sub(_plain, obj.docstring.value))
