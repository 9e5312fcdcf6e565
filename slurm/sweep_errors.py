"""The error of an invalid sweep file (its own module so that every sweep module can raise it)."""


class SweepError(ValueError):
    """An invalid sweep file; the message names the key (and run) at fault."""
