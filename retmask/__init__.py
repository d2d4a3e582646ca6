"""retmask: find the retrieval heads of a language model, switch them off, and train with the contrast."""

__version__ = "0.1.0"
