"""The NIXL transfer backend. ``import nixl`` happens in :mod:`.api` only, when first used."""
