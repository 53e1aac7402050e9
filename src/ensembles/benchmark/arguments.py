"""The command line's argument types: each parses one option's text or says why not.

Used by :mod:`ensembles.benchmark.cli` (``type=`` of its options); each raises
``argparse.ArgumentTypeError`` with the fix, which argparse prints with the
option's name. :func:`load_factory` imports the model a ``--model
package.module:factory`` names (a ``ValueError`` says why it cannot).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "choice_list",
    "int_list",
    "load_factory",
    "mesh_axes",
    "name_list",
    "positive_int",
    "shape",
]


def positive_int(text: str) -> int:
    """An integer >= 1.

    >>> from ensembles.benchmark.arguments import positive_int
    >>> positive_int("3")
    3
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer >= 1, got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers >= 1, duplicates dropped (ensemble sizes).

    >>> from ensembles.benchmark.arguments import int_list
    >>> int_list("1,4,4,8")
    (1, 4, 8)
    """
    parts = [part.strip() for part in text.split(",")]
    try:
        values = tuple(int(part) for part in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a comma-separated list of integers >= 1 such as 1,2,4,8; "
            f"got {text!r}"
        ) from None
    bad = [value for value in values if value < 1]
    if bad:
        raise argparse.ArgumentTypeError(
            f"every ensemble size E must be >= 1; got {text!r}"
        )
    return tuple(dict.fromkeys(values))


def shape(text: str) -> tuple[int, ...]:
    """One example's shape: comma-separated integers >= 1.

    >>> from ensembles.benchmark.arguments import shape
    >>> shape("32,32,3")
    (32, 32, 3)
    """
    try:
        values = tuple(int(part.strip()) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"must be one example's shape, comma-separated integers >= 1 such as "
            f"32,32,3; got {text!r}"
        )
    return values


def mesh_axes(text: str) -> dict[str, int]:
    """A device mesh: comma-separated ``axis=size`` pairs, in the mesh's order.

    >>> from ensembles.benchmark.arguments import mesh_axes
    >>> mesh_axes("data=4,model=2")
    {'data': 4, 'model': 2}
    """
    axes: dict[str, int] = {}
    for part in text.split(","):
        name, _, size = part.strip().partition("=")
        name = name.strip()
        try:
            value = int(size)
        except ValueError:
            value = 0
        if not name.isidentifier() or value < 1 or name in axes:
            raise argparse.ArgumentTypeError(
                f"must be a mesh's axes, comma-separated distinct name=size pairs "
                f"with sizes >= 1 such as data=8 or data=4,model=2; got {text!r}"
            )
        axes[name] = value
    return axes


def name_list(text: str) -> tuple[str, ...]:
    """Comma-separated names, duplicates dropped.

    >>> from ensembles.benchmark.arguments import name_list
    >>> name_list("mlp, cnn,mlp")
    ('mlp', 'cnn')
    """
    return tuple(dict.fromkeys(part.strip() for part in text.split(",")))


def choice_list(
    choices: Sequence[str], groups: dict[str, Sequence[str]] | None = None
) -> Callable[[str], tuple[str, ...]]:
    """A parser of comma-separated names from ``choices`` (or of ``groups``).

    A group's name stands for its names, in order; a name given twice counts
    once.

    >>> from ensembles.benchmark.arguments import choice_list
    >>> choice_list(("forward", "train"))("train")
    ('train',)
    >>> choice_list(("a", "b", "c"), {"ab": ("a", "b")})("c,ab,a")
    ('c', 'a', 'b')
    """
    groups = dict(groups or {})

    def parse(text: str) -> tuple[str, ...]:
        values = tuple(part.strip() for part in text.split(","))
        unknown = [v for v in values if v not in choices and v not in groups]
        if unknown:
            named = ", ".join([*choices, *groups])
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, unknown))}; choose from "
                f"{named} (comma-separated for several)"
            )
        expanded = [name for v in values for name in groups.get(v, (v,))]
        return tuple(dict.fromkeys(expanded))

    return parse


def load_factory(reference: str) -> Callable[..., Any]:
    """Imports ``"package.module:factory"``: a user's model factory.

    The working directory is searched first, as ``python -m`` and the
    interpreter's prompt do, so ``--model mymodel:build`` finds
    ``mymodel.py`` in the folder the command runs in.

    >>> from ensembles.benchmark.arguments import load_factory
    >>> load_factory("ensembles.benchmark.quality.models:build_quality_model")
    <function build_quality_model at ...>

    Args:
      reference: the module's import path, a colon, the factory's name.

    Returns:
      The factory.

    Raises:
      ValueError: if the reference is malformed, the module cannot be
        imported, or it has no such callable.
    """
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise ValueError(
            f"a model factory is named 'package.module:factory', got {reference!r}"
        )
    # A console script's sys.path starts with the script's folder, not the
    # working directory that `python -m` would put there.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"cannot import {module_name!r} (searched the working directory "
            f"{os.getcwd()} and the installed packages; if it lives elsewhere, "
            f"add its folder to PYTHONPATH): {error}"
        ) from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"{module_name!r} has no callable {attribute!r}")
    return factory
