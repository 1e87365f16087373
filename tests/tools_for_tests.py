"""Tools the environment tests run in worker processes: a module without JAX, so tool workers start fast."""
import os, time


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return str(a + b)


def boom(x: int) -> str:
    """Raise.

    Args:
        x: anything
    """
    raise RuntimeError("a buggy tool")


def exits(x: int) -> str:
    """Raise SystemExit inside the tool.

    Args:
        x: anything
    """
    raise SystemExit(3)


def hangs(x: int) -> str:
    """Never return.

    Args:
        x: anything
    """
    while True: time.sleep(1)


def number(x: int) -> str:
    """Return an int, not a string.

    Args:
        x: the int
    """
    return x


def flood(n: int) -> str:
    """Return n characters.

    Args:
        n: how many
    """
    return "x" * n


def dies(x: int) -> str:
    """End the worker process.

    Args:
        x: anything
    """
    os._exit(1)
