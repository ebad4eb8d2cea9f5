"""Typed errors. Each names the file, tensor, field or request part at fault."""


class StrataError(Exception):
    """Base class of every error Strata raises on bad input."""


class ConfigError(StrataError):
    """A model or engine configuration field is missing, malformed or inconsistent."""


class CheckpointError(StrataError):
    """A checkpoint file, index or tensor is missing, truncated or of the wrong dtype/shape."""


class CapacityError(StrataError):
    """A request does not fit the configured context capacity."""
