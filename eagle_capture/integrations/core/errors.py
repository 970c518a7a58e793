"""The errors both plugins raise, one class each: the plugins' policies
(``EAGLE_CAPTURE_ON_PROBLEM``) and a user's ``except`` catch the same class
whichever engine runs."""

__all__ = ["PluginError", "UnsupportedServer", "WrongCaptureLayers"]


class WrongCaptureLayers(ValueError):
    """Layer ids that would hand the draft other layers than it was trained on
    (the engine's own capture would too): the plugin refuses to start
    (``EAGLE_CAPTURE_ON_PROBLEM=refuse``) or logs it (``install``)."""


class UnsupportedServer(ValueError):
    """A deployment the fused capture does not handle: the engine's own capture
    stays, with one log line saying why."""


class PluginError(RuntimeError):
    """The plugin cannot hook this engine, or one of its settings is malformed."""
