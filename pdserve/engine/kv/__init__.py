"""KV-cache pages: the layout both attention and NIXL read (``layout.py``), the page ids and
their allocator, the one page owner (``cache.py``) and the prefix cache."""
