"""The NIXL transfer backend. ``import nixl`` happens in :mod:`.agent.api` only, when first used.

Laid out by side: :mod:`.agent` (what both share), :mod:`.prefill`, :mod:`.decode`;
:mod:`.factory` makes a manager of either role."""
