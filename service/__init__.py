"""lapguard's online half: the FastAPI detection service (``lapguard serve``).

Depends on :mod:`detector` only, never on ``training``: a served bundle needs no training stack.
"""
