"""What one eager BatchEnsembleLinear call runs of the library, counted.

The Python calls into ``src/ensembles`` of one eager
``BatchEnsembleLinear(64, 32, num_members=4)(x)`` on ``x[16, 64]``, and the
library frames on the stack when ``jax.lax.dot_general`` is called::

    python -m benchmarks.call_path
"""

import os
import sys

import jax
import jax.numpy as jnp
from flax import nnx

import ensembles

LIBRARY = os.path.dirname(ensembles.__file__)


def trace_call(layer, x):
    """``(calls, frames)``: the library functions called (in order) and the
    library frames between the call and ``lax.dot_general`` (outermost first)."""
    calls, frames = [], []

    def profile(frame, event, arg):
        code = frame.f_code
        if event != "call":
            return
        if code.co_filename.startswith(LIBRARY) and not code.co_name.startswith("<"):
            calls.append(f"{os.path.relpath(code.co_filename, LIBRARY)}:{code.co_name}")
        if code.co_name == "dot_general" and not frames:
            outer = frame.f_back
            while outer is not None:
                if outer.f_code.co_filename.startswith(LIBRARY):
                    frames.append(outer.f_code.co_name)
                outer = outer.f_back
            frames.reverse()

    sys.setprofile(profile)
    try:
        jax.block_until_ready(layer(x))
    finally:
        sys.setprofile(None)
    return calls, frames


def main():
    layer = ensembles.BatchEnsembleLinear(64, 32, num_members=4, rngs=nnx.Rngs(0))
    x = jnp.ones((16, 64))
    layer(x)  # first call: JAX's caches
    calls, frames = trace_call(layer, x)
    print(f"{len(calls)} calls into src/ensembles:")
    for call in calls:
        print("  ", call)
    print(f"{len(frames)} library frames from __call__ to lax.dot_general:")
    print("  ", " -> ".join(frames))


if __name__ == "__main__":
    main()
