"""Reading and writing, by job: datasets and their formats (``data/``), checkpoints
(``checkpoints/``), and torch's losses read as sharp's (``torch_losses/``)."""
