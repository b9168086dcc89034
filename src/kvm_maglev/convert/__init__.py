"""Converters from research checkpoints to Hub-ready transformers folders."""
