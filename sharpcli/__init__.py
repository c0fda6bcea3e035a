"""sharp: measure and control the sharpness of neural-network loss landscapes.

The command-line tool ``sharp`` is a thin layer over this library; every
analysis is importable (``sharpcli.curvature``, ``sharpcli.analyses``,
``sharpcli.training``) for use from scripts.
"""

__version__ = "0.1.0"
SCHEMA_ID = "sharpcli.report/2"
