"""What travels between processes, as bytes: the envelope and its kinds, typed payloads,
signing (``auth``), framing, the optional C codec, CurveZMQ keys, pickling and shared-memory
segments.  It imports no sibling room of runtime/ (only ``runtime/config.py``)."""
