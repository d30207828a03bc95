"""KV-cache pages: the layout both attention and NIXL read (``layout.py``), and in
``cache.py`` the one page owner with the page ids, their run allocator and the prefix cache."""
