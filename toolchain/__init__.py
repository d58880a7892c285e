"""dsedge.toolchain — the host side: sources, export, compression, validation, bundle building, training.

May import torch (lazily, inside the functions that need it); writes bundles with dsedge.runtime's format.
"""
