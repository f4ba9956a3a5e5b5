"""Flax NNX LLaMA pre-training example for fisher_optax."""
