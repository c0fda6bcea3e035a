"""The ``sharp`` command-line interface: the typer app and one module per command."""
