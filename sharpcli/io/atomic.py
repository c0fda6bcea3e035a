"""Moved to :mod:`sharpcli.atomic` (below report/, which writes plots with it); this name stays
for the training modules that still import it from here, until they switch."""

from sharpcli.atomic import atomic_path, check_writable, write_atomic, write_text_atomic

__all__ = ["atomic_path", "check_writable", "write_atomic", "write_text_atomic"]
