"""Strata: a DeepSeek-V4.1-Flash inference engine."""

__version__ = "0.1.0"
