"""Reading and writing, by job: datasets and their formats (``data/``), checkpoints
(``checkpoints/``), and the library's in-memory data and torch losses."""
