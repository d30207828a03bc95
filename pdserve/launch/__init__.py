"""``pdserve up``: prefill + decode workers and a router on this machine, supervised."""
