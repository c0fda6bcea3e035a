"""Reading and writing: checkpoints, datasets (built-in, vision, files) and safe unpickling."""
