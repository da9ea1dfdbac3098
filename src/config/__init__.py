"""Preflight: validate the composed config, derive values (global batch, ds_config.json, tokenizer), instantiate callbacks and loggers."""

__all__ = []
