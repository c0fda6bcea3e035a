"""torch's losses as sharp's: a loss module or spec and its options, how it reads a model's
outputs and labels, and a Hugging Face causal LM's own loss."""
