"""Explicit covering sets of test cases, checked, instead of cartesian products.

A full product of parametrize axes (rank x E x dtype x jit, say) compiles one
program per combination, although the axes rarely interact beyond pairs. The
tests list the combinations they run instead, and :func:`covering` checks at
collection that the list still covers what the product did: every value of
every axis, and every combination of values of each pair of axes named in
``pairs`` (by default every pair). Editing a list so that it loses a value or
a pair fails the collection of its module, not silently the coverage.
"""

import itertools


def covering(axes, cases, pairs=None):
    """``cases`` (tuples in the order of ``axes``), once checked against ``axes``.

    Args:
      axes: ``{name: values}``: the values each axis must take.
      cases: the combinations run, each a tuple with one value per axis.
      pairs: the pairs of axis names whose every combination of values must
        occur; ``None``: every pair.

    Returns:
      ``cases`` as a list, for ``pytest.mark.parametrize``.

    Raises:
      AssertionError: a case with a value outside its axis, or a value or a
        pair of values that no case takes.
    """
    names = list(axes)
    cases = [tuple(case) for case in cases]
    for case in cases:
        assert len(case) == len(names), (case, names)
        for name, value in zip(names, case, strict=True):
            assert value in axes[name], f"{name}={value!r} is not one of {axes[name]}"
    for i, name in enumerate(names):
        missing = [v for v in axes[name] if all(case[i] != v for case in cases)]
        assert not missing, f"no case has {name} in {missing}"
    if pairs is None:
        pairs = list(itertools.combinations(names, 2))
    for a, b in pairs:
        i, j = names.index(a), names.index(b)
        seen = {(case[i], case[j]) for case in cases}
        missing = [
            pair for pair in itertools.product(axes[a], axes[b]) if pair not in seen
        ]
        assert not missing, f"no case has ({a}, {b}) in {missing}"
    assert len(set(cases)) == len(cases), "a case is listed twice"
    return cases
