"""A user runner module whose import never finishes in any reasonable time."""

import time

time.sleep(3600)  # clock-ok: a test fixture that stands for a hung import


def factory() -> object:
    raise AssertionError("never reached")
