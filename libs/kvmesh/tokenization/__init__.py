"""Tokenization for kvmesh: the tiny test model generator and the chat tokenizer the router uses."""

from kvmesh.tokenization.tokenizer import ChatTokenizer, TokenizerError, load_tokenizer

__all__ = ["ChatTokenizer", "TokenizerError", "load_tokenizer"]
