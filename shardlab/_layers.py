"""Layers import only downward; a package is completed from above when it is loaded.

The class (:mod:`shardlab.tensor`) is the bottom of what a user imports, and it does
nothing without the engine and the ops above it, which it may not import. So the top
package (``shardlab/__init__.py``) registers here what completes it, and the class's
package calls :func:`loaded` once it is defined: the engine and the ops then import it and
install themselves on it (their tables: ``shardlab.tensor.entry.install``).
"""

from __future__ import annotations

__all__ = ["after", "loaded"]

_AFTER: dict[str, list] = {}


def after(name: str, fn) -> None:
    """Run ``fn()`` once the package ``name`` calls :func:`loaded`."""
    _AFTER.setdefault(name, []).append(fn)


def loaded(name: str) -> None:
    """The package ``name`` is defined: run what completes it (each once)."""
    for fn in _AFTER.pop(name, ()):
        fn()
