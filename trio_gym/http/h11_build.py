"""The h11 this process speaks HTTP with: ``h11-mypyc`` (h11 compiled with mypyc, the same API,
the ``fast`` extra) when it is installed, h11 itself otherwise.

Every module of trio_gym takes h11 from here, so that one build's events and errors meet only
each other: an ``isinstance`` against the other build's ``Request`` would never hold.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import h11 as h11
else:
    try:
        import h11_mypyc as h11
    except ImportError:
        import h11

__all__ = ["h11"]
