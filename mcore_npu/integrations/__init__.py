"""Adapters for other frameworks (verl, Hugging Face bridges), imported only on demand.

``import mcore_npu`` never imports this package or the frameworks it adapts to.
"""
