"""``python -m sharpcli`` is the same as the ``sharp`` command."""

from sharpcli.cli.app import main

if __name__ == "__main__":
    main()
