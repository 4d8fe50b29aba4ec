"""The builtin engine (PyTorch + transformers): the only package that imports torch."""
